"""A Triton vendor's :class:`~glm5_core.registry.Backend`, from what the vendor brings: its device facts, its device
probe, its kernel table (the shared kernels with its launch configs) and its priority. What every Triton vendor shares
is filled in here once: the probe (the vendor's device and triton, or the interpreter on CPU tensors), the runtime
device (``cpu`` under the interpreter), the missing-op reasons and detection by the device probe.

Import-light: triton is imported by the vendor's ``kernel_table`` only.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Callable, Optional, Union

from glm5_core import platform
from glm5_core.backends.triton.table import MISSING
from glm5_core.device_facts import DeviceFacts
from glm5_core.registry import Backend, Kernel


def triton_backend(name: str, facts: DeviceFacts, device_probe: Callable[[], tuple[bool, str]],
                   kernel_table: Callable[[], Mapping[str, Union[Kernel, Callable]]], *, description: str,
                   priority: int, missing: Optional[Mapping[str, str]] = None,
                   interpreted_without_device: bool = True) -> Backend:
    """The backend of a Triton vendor named ``name``; ``device_probe()`` is its cached ``(available, reason)``.
    ``missing``: the vendor's own reasons for ops it runs the reference for, added to the shared ones.

    ``interpreted_without_device``: under ``TRITON_INTERPRET=1`` the backend is available on any host (the kernels
    run on CPU tensors), so the test suite checks its kernels; False: only where its device probe passes (its real
    device, or its simulated one, ``glm5_core.backends.simulated``), so a vendor whose launch tiles another vendor's
    tests already run does not multiply the interpreted suite."""
    probe = functools.partial(platform.triton_backend_probe, device_probe)
    if not interpreted_without_device:
        probe = functools.partial(_device_then_triton, device_probe)
    return Backend(
        name=name,
        facts=facts,
        probe=probe,
        kernel_table=kernel_table,
        missing={**MISSING, **(missing or {})},  # MISSING: shared by every Triton vendor
        runtime_device=functools.partial(platform.triton_runtime_device, facts.device_type),
        description=description,
        detect=lambda: device_probe()[0],
        priority=priority,
    )


def _device_then_triton(device_probe: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    ok, why = device_probe()
    return platform.triton_backend_probe(device_probe) if ok else (False, why)
