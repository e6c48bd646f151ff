"""Launch configurations of the Triton kernels: each kernel module's default, and each vendor's overrides.

The kernels (in this package) are vendor-neutral; what differs between vendors is how they are launched: tile
sizes, ``num_warps`` (a warp is as wide as the vendor's SIMD group, so the sensible bound differs), ``num_stages``
and vendor-only compiler knobs (``extra``). Each kernel module declares its ``DEFAULT_LAUNCH`` next to its
``FAMILY`` (the family is the module's name); a vendor's :class:`KernelConfigs` (in its ``launch.py``) holds its
shared memory per block and only the families it launches differently. ``configs.get(FAMILY,
DEFAULT_LAUNCH)`` is the vendor's override, else the module's default: a new kernel module is its module, and no
vendor table needs a line unless the vendor launches it differently.

Tile sizes are part of the numerics of the indexer (its key blocks fix the summation layout), so they
are constants of a table, never autotuned per shape: that keeps the top-k bitwise identical across
batch sizes and between prefill and decode.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping
from typing import Any, Callable, Optional

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

    def launch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``kernel[grid](..., **kwargs)``."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.extra}


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: one table per vendor, a module constant
class KernelConfigs:
    """A vendor's launch table: its name (namespaces its custom ops), the shared memory one block may use, in bytes
    (None: unchecked; see ``shared_memory``), and its ``overrides`` of the kernel modules' default launch
    configurations (family -> LaunchConfig). ``table.launch_config`` / ``table.launches`` give the effective
    configurations: the override, else the kernel module's ``DEFAULT_LAUNCH``."""

    vendor: str
    shared_memory_limit: Optional[int] = None
    overrides: Mapping[str, LaunchConfig] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for family, config in self.overrides.items():
            if not isinstance(config, LaunchConfig):
                raise TypeError(f"{self.vendor} launch table: {family}: expected a LaunchConfig, "
                                f"got {type(config).__name__}")
        object.__setattr__(self, "overrides", types.MappingProxyType(dict(self.overrides)))

    def get(self, family: str, default: LaunchConfig) -> LaunchConfig:
        """The launch configuration of ``family``: this vendor's override, else ``default`` (the kernel module's
        ``DEFAULT_LAUNCH``; ``table.launch_config`` looks it up by name)."""
        return self.overrides.get(family, default)


def bind(fn: Callable, config: LaunchConfig, supports: Optional[Callable] = None,
         differentiable: bool = False) -> Kernel:
    """A kernel record running ``fn`` with ``config=`` fixed (keeping ``fn``'s module and name for ``explain``)."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        return fn(*args, config=config, **kwargs)

    return Kernel(kernel, supports=supports, differentiable=differentiable)


def tiles_64kib(num_warps: int) -> dict[str, LaunchConfig]:
    """The launch overrides of a vendor with 64 KiB of shared / on-chip memory per block: tiles that fit it at
    GLM-5's dims by ``shared_memory``'s estimate (tests/backends/triton/test_shared_memory.py), at the vendor's
    ``num_warps``. One table, so the vendors that share the limit share the tiles."""
    w = {"num_warps": num_warps, "num_stages": 1}
    return {
        "indexer": LaunchConfig(**w, blocks={"keys": 64}),
        "sparse_mla": LaunchConfig(**w, blocks={"heads": 4, "keys": 8}),
        "dsa_selected_attention_target": LaunchConfig(**w, blocks={"heads": 4, "keys": 8, "rows": 16, "cols": 8}),
        "moe_route": LaunchConfig(**w, blocks={"tokens": 16}),
        "moe_permute": LaunchConfig(**w, blocks={"rows": 512, "cols": 256}),
        "moe_experts": LaunchConfig(**w, blocks={"m": 64, "n": 64, "k": 32}),
        "newton_schulz": LaunchConfig(num_warps=num_warps, num_stages=2, blocks={"m": 64, "n": 64, "k": 32}),
    }
