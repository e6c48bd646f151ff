"""Launch configurations of the Triton kernels, one table per vendor.

The kernels (in this package) are vendor-neutral; what differs between NVIDIA and AMD is how they are
launched: tile sizes, ``num_warps`` (a warp is 32 lanes on NVIDIA, a wavefront 64 on AMD, so AMD keeps
``num_warps <= 16``), ``num_stages`` and AMD-only compiler knobs such as ``waves_per_eu``. Each launcher
takes a :class:`LaunchConfig` from a :class:`KernelConfigs` table, looked up by its kernel family name
(``configs["indexer"]``: the family is the kernel module's name, its ``FAMILY``); each vendor passes its own table.
A new kernel module is one more entry in each vendor's table: the class has no field per family.

Tile sizes are part of the numerics of the indexer (its key blocks fix the summation layout), so they
are constants of a table, never autotuned per shape: that keeps the top-k bitwise identical across
batch sizes and between prefill and decode.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Dict, Mapping, Optional

from glm5_core.kernel import Kernel


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How one kernel is launched. ``blocks`` holds named tile sizes (powers of two)."""

    num_warps: int = 4
    num_stages: int = 2
    blocks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # vendor-only compiler knobs

    def __post_init__(self):
        for name, size in self.blocks.items():
            assert size >= 1 and size & (size - 1) == 0, f"block {name}={size} must be a power of two"

    def block(self, name: str) -> int:
        return self.blocks[name]

    def launch_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``kernel[grid](..., **kwargs)``."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.extra}


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: one table per vendor, a module constant
class KernelConfigs:
    """One launch configuration per kernel family (``"indexer"``, ``"sparse_mla"``, ...), plus the vendor's
    name (namespaces its custom ops) and the shared memory one block may use, in bytes (None: unchecked; see
    ``shared_memory``). ``configs[family]`` names the vendor and the family it lacks."""

    vendor: str
    families: Mapping[str, LaunchConfig]
    shared_memory_limit: Optional[int] = None

    def __post_init__(self):
        for family, config in self.families.items():
            if not isinstance(config, LaunchConfig):
                raise TypeError(f"{self.vendor} launch table: {family}: expected a LaunchConfig, "
                                f"got {type(config).__name__}")
        object.__setattr__(self, "families", types.MappingProxyType(dict(self.families)))

    def __getitem__(self, family: str) -> LaunchConfig:
        if family not in self.families:
            raise KeyError(f"the {self.vendor} launch table has no configuration for the Triton kernel family "
                           f"{family!r}; add one to its KernelConfigs (it has: {', '.join(self.families)})")
        return self.families[family]


def bind(fn: Callable, config: LaunchConfig, supports: Optional[Callable] = None,
         differentiable: bool = False) -> Kernel:
    """A kernel record running ``fn`` with ``config=`` fixed (keeping ``fn``'s module and name for ``explain``)."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        return fn(*args, config=config, **kwargs)

    return Kernel(kernel, supports=supports, differentiable=differentiable)
