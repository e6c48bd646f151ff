"""Shared memory a Triton launch needs, estimated from its tile shapes and dtypes.

The tiles of each kernel are declared by its kernel module (``tiles`` and ``ITEMSIZES``, see ``table.py``); this
module holds the formula and the model dims, and imports triton only when it reads a kernel module's tiles
(``estimate``, ``over_limit``).

A block's shared memory is bounded per device: each vendor declares its bound, in bytes per block, as the
``shared_memory_limit`` of its launch table (``KernelConfigs``, in its ``launch.py``, with the device it holds
for). A launch over the limit fails at compile or launch time on real hardware, while Triton's CPU interpreter
runs it, so every vendor's launches are checked against its limit with this estimate
(``tests/backends/triton/test_shared_memory.py``).

The formula, per kernel, over the tiles it holds:

  bytes = sum over the operand tiles of its tl.dot calls, each distinct tile once:
              prod(tile shape) x element size x (num_stages if the tile is loaded inside a pipelined loop else 1)
        + the largest scratch tile: a reduction, scan or layout change that crosses warps stages its tile
          (at most) through shared memory, one at a time; a dot's fp32 result joining a loop-carried
          accumulator of another layout is such a change (the accumulator tile counts)

* Every tl.dot operand is staged through shared memory (ahead of the matrix instructions; each vendor's
  ``launch.py`` says which); the element size is the operand's dtype *at the dot* (an fp16 tile widened to fp32
  before the dot counts 4 bytes, a tile cast to bf16 for tensor cores 2).
* All of a kernel's operand tiles count as live at once. That is an upper bound: the allocator reuses a buffer
  whose live range has ended. Compiled for sm_90 the old fp32 sparse-MLA dkv launch (heads 16, keys 64) took
  exactly its operand tiles' sum (225,280 bytes); for gfx942 its largest tile (131,072 bytes, the gathered [64, 512]
  latent rows), which is the 128 KB that did not fit (see ``benchmarks/results/shared_memory_probe.md``).
* The software pipeliner keeps ``num_stages`` copies of a tile loaded in a loop (a load the loop's first
  iteration needs is prefetched while the previous one is consumed); loop-invariant tiles are held once.

Tile sizes of a kernel follow the model (latent width, heads, ...) as well as the launch table, so the check
runs at the largest dims glm5-core launches with: GLM-5's (``GLM5_DIMS``, from GLM-5's ``config.json``:
kv_lora_rank, qk_rope_head_dim, index_n_heads, index_head_dim, index_topk, n_routed_experts, num_experts_per_tok).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Tile:
    """A tile a kernel holds in shared memory: a tl.dot operand (or a cross-warp reduction's input)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int  # bytes per element, as the tile enters the dot
    pipelined: bool = False  # loaded inside a loop the software pipeliner multi-buffers
    scratch: bool = False  # a reduction's / layout change's staging, not a dot operand

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def launch_bytes(tiles: list[Tile], num_stages: int) -> int:
    """The estimate: every dot operand once (a pipelined one ``num_stages`` times), plus the largest scratch."""
    operands = sum(t.nbytes * (max(1, num_stages) if t.pipelined else 1) for t in tiles if not t.scratch)
    return operands + max([t.nbytes for t in tiles if t.scratch], default=0)


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The model dims the kernels' tiles depend on."""

    latent: int  # kv_lora_rank (C)
    rope: int  # qk_rope_head_dim (Dr)
    indexer_heads: int
    indexer_head_dim: int
    index_topk: int
    experts: int
    experts_per_token: int


GLM5_DIMS = ModelDims(latent=512, rope=64, indexer_heads=32, indexer_head_dim=128, index_topk=2048, experts=256,
                      experts_per_token=8)


def family_tiles(family: str) -> Callable[..., dict[str, list[Tile]]]:
    """The ``tiles`` function of the kernel module of ``family`` (imports it, so triton)."""
    from glm5_core.backends.triton import kernel_modules

    try:
        return kernel_modules.kernel_module(family).tiles
    except KeyError:
        raise KeyError(f"family: no shared-memory estimate for the Triton kernel family {family!r}; a kernel module "
                       f"defines it (they are: {', '.join(kernel_modules.kernel_families())})") from None


def itemsizes(family: str) -> tuple[int, ...]:
    """The input element sizes (bytes) the kernels of ``family`` are launched with."""
    from glm5_core.backends.triton import kernel_modules

    return kernel_modules.kernel_module(family).ITEMSIZES


def estimate(family: str, config, dims: ModelDims = GLM5_DIMS) -> dict[tuple[str, int], int]:
    """{(kernel, input itemsize): estimated bytes} for every kernel of ``family`` launched with ``config``."""
    tiles_of = family_tiles(family)
    out = {}
    for itemsize in itemsizes(family):
        for kernel, tiles in tiles_of(dict(config.blocks), dims, itemsize).items():
            out[(kernel, itemsize)] = launch_bytes(tiles, config.num_stages)
    return out


def over_limit(family: str, config, limit: int, dims: ModelDims = GLM5_DIMS, itemsize: int = 4) -> str:
    """Why a launch of ``family`` with ``config`` at ``dims`` (inputs of ``itemsize`` bytes) needs more than
    ``limit`` bytes of shared memory per block ("" when every kernel of the family fits)."""
    for kernel, tiles in family_tiles(family)(dict(config.blocks), dims, itemsize).items():
        need = launch_bytes(tiles, config.num_stages)
        if need > limit:
            return f"its {kernel} kernel needs ~{need} bytes of shared memory per block, over this GPU's {limit}"
    return ""
