"""Shared memory a Triton launch needs, estimated from its tile shapes and dtypes (no triton import).

A block's shared memory (NVIDIA SMEM, AMD LDS) is bounded per vendor: 64 KiB of LDS per workgroup on gfx942
(MI300X), 227 KiB per block (opt-in) on Hopper (H100 / H200). A launch over the limit fails at compile or launch
time on real hardware, while Triton's CPU interpreter runs it, so the launch tables are checked against the
limits with this estimate (``tests/cuda/test_shared_memory.py``).

The formula, per kernel, over the tiles it holds:

  bytes = sum over the operand tiles of its tl.dot calls, each distinct tile once:
              prod(tile shape) x element size x (num_stages if the tile is loaded inside a pipelined loop else 1)
        + the largest scratch tile: a reduction, scan or layout change that crosses warps stages its tile
          (at most) through shared memory, one at a time; a dot's fp32 result joining a loop-carried
          accumulator of another layout is such a change (the accumulator tile counts)

* Every tl.dot operand is staged through shared memory (NVIDIA: ldmatrix / wgmma operands, AMD: LDS ahead of
  MFMA); the element size is the operand's dtype *at the dot* (an fp16 tile widened to fp32 before the dot
  counts 4 bytes, a tile cast to bf16 for tensor cores 2).
* All of a kernel's operand tiles count as live at once. That is an upper bound: the allocator reuses a buffer
  whose live range has ended. Compiled for sm_90 the old fp32 sparse-MLA dkv launch (heads 16, keys 64) took
  exactly its operand tiles' sum (225,280 bytes); for gfx942 its largest tile (131,072 bytes, the gathered [64, 512]
  latent rows), which is the 128 KB that did not fit (see ``benchmarks/results/shared_memory_probe.md``).
* The software pipeliner keeps ``num_stages`` copies of a tile loaded in a loop (a load the loop's first
  iteration needs is prefetched while the previous one is consumed); loop-invariant tiles are held once.

Tile sizes of a kernel follow the model (latent width, heads, ...) as well as the launch table, so the check
runs at the largest dims glm5-core launches with: GLM-5's (``GLM5_DIMS``: its published config, ``GLM5Config.glm5()``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Tuple

from glm5_core.backends.triton._util import next_pow2

# Per block / workgroup, bytes.
SHARED_MEMORY_LIMITS = {
    "cuda": 227 * 1024,  # Hopper (H100 / H200): 228 KiB per SM, of which 227 KiB can be opted into by one block
    "rocm": 64 * 1024,  # CDNA3 (gfx942, MI300X): 64 KiB of LDS per workgroup
}


@dataclasses.dataclass(frozen=True)
class Tile:
    """A tile a kernel holds in shared memory: a tl.dot operand (or a cross-warp reduction's input)."""

    name: str
    shape: Tuple[int, ...]
    itemsize: int  # bytes per element, as the tile enters the dot
    pipelined: bool = False  # loaded inside a loop the software pipeliner multi-buffers
    scratch: bool = False  # a reduction's / layout change's staging, not a dot operand

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def launch_bytes(tiles: List[Tile], num_stages: int) -> int:
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


def _indexer(blocks, dims: ModelDims, itemsize: int) -> Dict[str, List[Tile]]:
    BS = blocks["keys"]
    H_PAD, D_PAD = next_pow2(dims.indexer_heads, 16), next_pow2(dims.indexer_head_dim, 16)
    KP = next_pow2(dims.index_topk, BS)
    q, k = Tile("q", (H_PAD, D_PAD), itemsize), Tile("k", (BS, D_PAD), itemsize, pipelined=True)
    dots = Tile("dots", (H_PAD, BS), 4, scratch=True)  # fp32 q . k, summed over heads
    return {
        # the bitonic merge reduces and reshapes int64 [2] * log2(KP) views of the best keys
        "indexer_topk": [q, k, dots, Tile("merge", (KP,), 8, scratch=True)],
        "indexer_scores": [q, dataclasses.replace(k, pipelined=False), dots],
    }


def _sparse_mla(blocks, dims: ModelDims, itemsize: int) -> Dict[str, List[Tile]]:
    """itemsize 4: the fp32 path (keys widened to fp32); 2: the bf16 tensor-core path (every operand bf16)."""
    BH, BK = blocks["heads"], blocks["keys"]
    C, DR = next_pow2(dims.latent, 16), next_pow2(dims.rope, 16)
    head_tiles = [Tile("q_lat", (BH, C), itemsize), Tile("q_pe", (BH, DR), itemsize)]
    key_tiles = [Tile("kv", (BK, C), itemsize, pipelined=True), Tile("kr", (BK, DR), itemsize, pipelined=True)]
    d_out = Tile("d_out", (BH, C), itemsize)
    p, ds = Tile("p", (BH, BK), itemsize), Tile("ds", (BH, BK), itemsize)
    # dkv: the keys are loop-invariant there and the head tiles are loaded in its loop over heads
    dkv_heads = [dataclasses.replace(t, pipelined=True) for t in head_tiles + [d_out]]
    dkv_keys = [dataclasses.replace(t, pipelined=False) for t in key_tiles]
    head_acc, key_acc = Tile("acc", (BH, C), 4, scratch=True), Tile("acc", (BK, C), 4, scratch=True)  # fp32
    return {
        "sparse_fwd": head_tiles + key_tiles + [p, head_acc],
        "sparse_bwd_dq": head_tiles + [d_out] + key_tiles + [ds, head_acc],
        "sparse_bwd_dkv": dkv_heads + dkv_keys + [p, ds, key_acc],
    }


def _attention_target(blocks, dims: ModelDims, itemsize: int) -> Dict[str, List[Tile]]:
    """Every operand is widened to fp32 before its dot, whatever the input dtype."""
    BH, BK, BM, BS = blocks["heads"], blocks["keys"], blocks["rows"], blocks["cols"]
    C, DR = next_pow2(dims.latent, 16), next_pow2(dims.rope, 16)
    heads = [Tile("q_lat", (BH, C), 4), Tile("q_pe", (BH, DR), 4)]
    keys = [Tile("kv", (BK, C), 4, pipelined=True), Tile("kr", (BK, DR), 4, pipelined=True)]
    scores = Tile("scores", (BH, BK), 4, scratch=True)  # max / sum over keys (lse), over heads (target)
    return {
        "selected_lse": heads + keys + [scores],
        # the target kernel's keys are loop-invariant; its head tiles are loaded in its loop over heads
        "target": [dataclasses.replace(t, pipelined=True) for t in heads]
                  + [dataclasses.replace(t, pipelined=False) for t in keys] + [scores],
        "causal_lse": [Tile("q_lat", (BM, C), 4), Tile("q_pe", (BM, DR), 4), Tile("kv", (BS, C), 4, pipelined=True),
                       Tile("kr", (BS, DR), 4, pipelined=True), Tile("scores", (BM, BS), 4, scratch=True)],
    }


def _grouped_gemm(blocks, dims: ModelDims, itemsize: int) -> Dict[str, List[Tile]]:
    """The experts widen every tile to fp32 before its dot, whatever the input dtype."""
    BM, BN, BK = blocks["m"], blocks["n"], blocks["k"]
    rows = lambda name: Tile(name, (BM, BK), 4, pipelined=True)  # noqa: E731
    cols = lambda name: Tile(name, (BN, BK), 4, pipelined=True)  # noqa: E731
    acc = Tile("acc", (BM, BN), 4, scratch=True)  # every kernel's fp32 accumulators are [BM, BN] (BI = m, BJ = n)
    return {
        "grouped_gemm": [rows("a"), cols("b1"), cols("b2"), acc],
        "swiglu_bwd": [rows("x"), rows("d_out"), cols("w_gate"), cols("w_up"), cols("w_down"), acc],
        "grouped_dx": [rows("d_gate"), rows("d_up"), cols("w_gate"), cols("w_up"), acc],
        # weight gradients: BI = m, BJ = n over BR = k rows
        "grouped_wgrad": [Tile("a1", (BK, BM), 4, True), Tile("a2", (BK, BM), 4, True), Tile("b", (BK, BN), 4, True),
                          acc],
    }


def _newton_schulz(blocks, dims: ModelDims, itemsize: int) -> Dict[str, List[Tile]]:
    BM, BN, BK = blocks["m"], blocks["n"], blocks["k"]
    return {
        "symmetric": [Tile("y_i", (BM, BK), itemsize, True), Tile("y_j", (BM, BK), itemsize, True),
                      Tile("acc", (BM, BM), 4, scratch=True)],
        "gemm": [Tile("b", (BM, BK), itemsize, True), Tile("x", (BK, BN), itemsize, True),
                 Tile("acc", (BM, BN), 4, scratch=True)],
    }


def _moe_route(blocks, dims: ModelDims, itemsize: int) -> Dict[str, List[Tile]]:
    E_PAD = next_pow2(dims.experts)
    return {"route": [Tile("scores", (blocks["tokens"], E_PAD), 4, scratch=True)]}  # argmax / max / sum over experts


def _moe_permute(blocks, dims: ModelDims, itemsize: int) -> Dict[str, List[Tile]]:
    BR, BD = blocks["rows"], blocks["cols"]
    return {
        "count": [Tile("ids", (BR,), 8, scratch=True)],
        "place": [Tile("ids", (BR,), 8, scratch=True)],  # cumsum
        "gather_rows": [],
        "combine": [],
        "combine_weight_grad": [Tile("acc", (BD,), 4, scratch=True)],
    }


FAMILY_TILES: Dict[str, Callable[..., Dict[str, List[Tile]]]] = {
    "indexer": _indexer,
    "sparse_mla": _sparse_mla,
    "attention_target": _attention_target,
    "grouped_gemm": _grouped_gemm,
    "newton_schulz": _newton_schulz,
    "moe_route": _moe_route,
    "moe_permute": _moe_permute,
}
ITEMSIZES = {  # the input dtypes each family is launched with, as bytes per element
    "indexer": (4, 2),
    "sparse_mla": (4, 2),
    "attention_target": (4,),
    "grouped_gemm": (4,),
    "newton_schulz": (4, 2),  # fp32 or bf16 compute
    "moe_route": (4,),
    "moe_permute": (4,),
}


def estimate(family: str, config, dims: ModelDims = GLM5_DIMS) -> Dict[Tuple[str, int], int]:
    """{(kernel, input itemsize): estimated bytes} for every kernel of ``family`` launched with ``config``."""
    if family not in FAMILY_TILES:
        raise KeyError(f"family: no shared-memory estimate for the Triton kernel family {family!r}; add one to "
                       f"FAMILY_TILES (it has: {', '.join(FAMILY_TILES)})")
    out = {}
    for itemsize in ITEMSIZES[family]:
        for kernel, tiles in FAMILY_TILES[family](dict(config.blocks), dims, itemsize).items():
            out[(kernel, itemsize)] = launch_bytes(tiles, config.num_stages)
    return out


def over_limit(family: str, config, limit: int, dims: ModelDims = GLM5_DIMS, itemsize: int = 4) -> str:
    """Why a launch of ``family`` with ``config`` at ``dims`` (inputs of ``itemsize`` bytes) needs more than
    ``limit`` bytes of shared memory per block ("" when every kernel of the family fits)."""
    for kernel, tiles in FAMILY_TILES[family](dict(config.blocks), dims, itemsize).items():
        need = launch_bytes(tiles, config.num_stages)
        if need > limit:
            return f"its {kernel} kernel needs ~{need} bytes of shared memory per block, over this GPU's {limit}"
    return ""
