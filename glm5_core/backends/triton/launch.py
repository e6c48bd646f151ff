"""Launch configurations of the Triton kernels, one table per vendor.

The kernels (in this package) are vendor-neutral; what differs between NVIDIA and AMD is how they are
launched: tile sizes, ``num_warps`` (a warp is 32 lanes on NVIDIA, a wavefront 64 on AMD, so AMD keeps
``num_warps <= 16``), ``num_stages`` and AMD-only compiler knobs such as ``waves_per_eu``. Each launcher
takes a :class:`LaunchConfig` from a :class:`KernelConfigs` table; the rocm backend passes its own table.

Tile sizes are part of the numerics of the indexer (its key blocks fix the summation layout), so they
are constants of a table, never autotuned per shape: that keeps the top-k bitwise identical across
batch sizes and between prefill and decode.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping


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
    """One launch configuration per kernel family, plus the vendor's name (namespaces its custom ops)."""

    vendor: str
    indexer: LaunchConfig
    sparse_mla: LaunchConfig
    moe_route: LaunchConfig
    moe_permute: LaunchConfig
    grouped_gemm: LaunchConfig
    newton_schulz: LaunchConfig
