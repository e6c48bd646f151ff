"""Declaration of the ``gcu`` backend: torch operators on Enflame GCUs (the shared Triton kernels index with int64:
offsets past 2^31 elements and the indexer's packed (score, index) keys, which the GCU does not compute), and an
int32-only top-k (``gcu/dsa.py``). Import-light: torch_gcu is imported by the probe only."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from glm5_core.backends import simulated
from glm5_core.backends.gcu.device import DEVICE, probe
from glm5_core.registry import Backend, Kernel

WHY_REFERENCE = ("the shared Triton kernels index with int64 (offsets past 2^31 elements, the indexer's packed "
                 "(score, index) keys) and the GCU computes no int64: the reference runs as torch operators "
                 "through torch_gcu")


class _EveryOp(Mapping):
    """The same reason for every op without a kernel here (so a new op needs no line)."""

    def __getitem__(self, op: str) -> str:
        return WHY_REFERENCE

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def runtime_device() -> str:
    return simulated.runtime_device("gcu", DEVICE.device_type)


def kernel_table() -> dict[str, Kernel]:
    from glm5_core.backends.gcu import dsa

    return dsa.kernels(runtime_device)


BACKEND = Backend(
    name="gcu",
    facts=DEVICE,
    probe=probe,
    kernel_table=kernel_table,
    missing=_EveryOp(),
    runtime_device=runtime_device,
    description="Enflame GCUs (torch_gcu): torch operators, an int32-only top-k",
    detect=lambda: probe()[0],
    priority=33,
)
