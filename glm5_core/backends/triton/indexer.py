"""Fused lightning indexer + deterministic top-k, and the indexer scores, as Triton kernels.

Legend: B batch, T queries, S key slots, H indexer heads, D head dim, K top-k width,
        Q = B * T query rows, KP = next power of two >= K, BS = key block (``config.block("keys")``).

One program owns one query row and streams that row's visible keys in blocks of BS:

  dots_HB  = q_HD @ k_BD^T                        (tl.dot, fp32 accumulation, exact fp32 products;
                                                   the interpreter: products summed over D)
  score_B  = sum_h w_h * relu(dots_HB[h])          (one tl.sum over the padded head axis)

Every score of key ``s`` is computed by the same instructions on the same operands whatever B, T or S
are (keys are blocked from slot 0, the block size is a constant of the launch table, the head axis is
padded to a constant), so the scores -- and hence the selected keys -- are bitwise identical across
batch sizes, chunkings, and between prefill (all queries) and decode (one query against a cache).

Top-k. A score and its key index are packed into one int64 whose order is "score descending, then
index ascending" (see ``_pack``), so the top-k of the packed keys *is* the contract's order and
the result does not depend on the order candidates are met in. Each program keeps, in a scratch row
of 2 * KP int64, its current best KP keys (sorted) and a staging area. Keys of a block that beat the
current k-th best are appended to the staging area; when it could overflow, a bitonic merge
(``bitonic.merge_top``) folds staging into best. Extra memory is O(Q * KP) (scratch) + O(H * BS) (registers):
never O(Q * S).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from glm5_core import platform
from glm5_core.backends.triton import _util
from glm5_core.backends.triton.bitonic import merge_top
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.kernel import Kernel
from glm5_core.ops import _checks
from glm5_core.ops import kpool_topk as kpool_topk_ops

_SENTINEL = -(2 ** 63)  # below every packed key: an empty slot
_INDEX_CEIL = 2 ** 31 - 1  # packed low word is _INDEX_CEIL - index (ascending index = descending word)


@triton.jit
def _block_scores(q_HD, w_H, k_ptr, stride_ks, stride_kd, s0, n_keys,
                  D: tl.constexpr, BS: tl.constexpr, D_PAD: tl.constexpr, INTERPRETED: tl.constexpr):
    """Scores of keys s0 .. s0+BS-1 for one query; keys >= n_keys get a garbage score (masked by callers).

    INTERPRETED (``TRITON_INTERPRET=1``, CPU tensors): the dots as fp32 products summed over D, not ``tl.dot``,
    which the interpreter hands to numpy's sgemm: OpenBLAS's AVX2 kernel gives equal key columns different
    roundings (at H_PAD 32, D 128), which breaks the contract's ties by index, and it has no bf16 (bf16
    products are exact in fp32). On a GPU ``tl.dot`` (ieee) gives every key column the same instructions."""
    offs_s = s0 + tl.arange(0, BS)
    offs_d = tl.arange(0, D_PAD)
    k_BD = tl.load(k_ptr + offs_s[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                   mask=(offs_s[:, None] < n_keys) & (offs_d[None, :] < D), other=0.0)
    if INTERPRETED:  # [H_PAD, D_PAD, 1] * [1, D_PAD, BS] summed over D: each column by the same sum
        dots_HB = tl.sum(q_HD.to(tl.float32)[:, :, None] * tl.trans(k_BD.to(tl.float32))[None, :, :], axis=1)
    else:
        dots_HB = tl.dot(q_HD, tl.trans(k_BD), input_precision="ieee")  # [H_PAD, BS] fp32 accumulation
    return tl.sum(w_H[:, None] * tl.maximum(dots_HB, 0.0), axis=0)  # [BS]


@triton.jit
def _load_query(q_ptr, w_ptr, row_b, row_t, stride_qb, stride_qt, stride_qh, stride_qd,
                stride_wb, stride_wt, stride_wh,
                H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    row_b = row_b.to(tl.int64)  # B * T * H * D can pass 2^31 elements: int32 offsets would wrap
    row_t = row_t.to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    q_HD = tl.load(q_ptr + row_b * stride_qb + row_t * stride_qt + offs_h[:, None] * stride_qh
                   + offs_d[None, :] * stride_qd, mask=(offs_h[:, None] < H) & (offs_d[None, :] < D), other=0.0)
    w_H = tl.load(w_ptr + row_b * stride_wb + row_t * stride_wt + offs_h * stride_wh,
                  mask=offs_h < H, other=0.0).to(tl.float32)
    return q_HD, w_H


@triton.jit
def _pack(score, offs_s):
    """(score fp32, index) -> int64 ordered by score, then by LOWER index. -0.0 is folded onto +0.0."""
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    return (ordered.to(tl.int64) << 32) | (2147483647 - offs_s).to(tl.int64)


@triton.jit
def _merge(scratch_row, n_staged, KP: tl.constexpr):
    """best <- top-KP of (best, staging[:n_staged]); returns the new k-th best packed key."""
    offs = tl.arange(0, KP)
    best = tl.load(scratch_row + offs)
    staged = tl.load(scratch_row + KP + offs, mask=offs < n_staged, other=-9223372036854775808)
    merged = merge_top(best, staged, KP)  # sorted descending
    tl.debug_barrier()
    tl.store(scratch_row + offs, merged)
    tl.debug_barrier()
    return tl.min(merged, axis=0)


@triton.jit
def _indexer_topk_kernel(q_ptr, k_ptr, w_ptr, start_ptr, out_ptr, scratch_ptr, nan_ptr,
                         T, S, K,
                         stride_qb, stride_qt, stride_qh, stride_qd,
                         stride_kb, stride_ks, stride_kd,
                         stride_wb, stride_wt, stride_wh,
                         H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                         BS: tl.constexpr, KP: tl.constexpr, INTERPRETED: tl.constexpr, POOL: tl.constexpr):
    row = tl.program_id(0)  # one query row: b * T + t
    row_b = row // T
    row_t = row % T
    pos = tl.load(start_ptr + row_b) + row_t  # absolute position: sees keys 0..pos
    # POOL > 1 (the k-pool indexer): keys are pools of POOL tokens, visible once their last token is
    n_keys = tl.minimum((pos + 1) // POOL, S)
    q_HD, w_H = _load_query(q_ptr, w_ptr, row_b, row_t, stride_qb, stride_qt, stride_qh, stride_qd,
                            stride_wb, stride_wt, stride_wh, H, D, H_PAD, D_PAD)
    k_row = k_ptr + row_b.to(tl.int64) * stride_kb
    scratch_row = scratch_ptr + row.to(tl.int64) * (2 * KP)  # [0, KP): best (sorted); [KP, 2KP): staging
    offs_kp = tl.arange(0, KP)
    tl.store(scratch_row + offs_kp, tl.full([KP], -9223372036854775808, tl.int64))
    tl.debug_barrier()

    kth = tl.full([], -9223372036854775808, tl.int64)  # a key must beat this to matter
    n_staged = tl.zeros([], tl.int32)
    saw_nan = tl.zeros([], tl.int32)  # a NaN score (inf - inf from finite inputs) has no place in the order
    for s0 in range(0, n_keys, BS):
        score = _block_scores(q_HD, w_H, k_row, stride_ks, stride_kd, s0, n_keys, D, BS, D_PAD, INTERPRETED)
        offs_s = s0 + tl.arange(0, BS)
        saw_nan = tl.maximum(saw_nan, tl.max(((score != score) & (offs_s < n_keys)).to(tl.int32), axis=0))
        packed = _pack(score, offs_s)
        keep = (offs_s < n_keys) & (packed > kth)
        if n_staged + tl.sum(keep.to(tl.int32), axis=0) > KP:  # staging would overflow: merge first
            kth = _merge(scratch_row, n_staged, KP)
            n_staged = tl.full([], 0, tl.int32)
            keep = keep & (packed > kth)
        slot = n_staged + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(scratch_row + KP + slot, packed, mask=keep)
        tl.debug_barrier()
        n_staged += tl.sum(keep.to(tl.int32), axis=0)
    _merge(scratch_row, n_staged, KP)

    best = tl.load(scratch_row + offs_kp)
    index = 2147483647 - (best & 0xFFFFFFFF).to(tl.int32)
    index = tl.where(best == -9223372036854775808, -1, index)
    tl.store(out_ptr + row.to(tl.int64) * K + offs_kp, index, mask=offs_kp < K)
    tl.store(nan_ptr + row, saw_nan.to(tl.int8))


@triton.jit
def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, start_ptr, out_ptr,
                           T, S,
                           stride_qb, stride_qt, stride_qh, stride_qd,
                           stride_kb, stride_ks, stride_kd,
                           stride_wb, stride_wt, stride_wh,
                           H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                           BS: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0)
    s0 = tl.program_id(1) * BS
    row_b = row // T
    row_t = row % T
    pos = tl.load(start_ptr + row_b) + row_t
    q_HD, w_H = _load_query(q_ptr, w_ptr, row_b, row_t, stride_qb, stride_qt, stride_qh, stride_qd,
                            stride_wb, stride_wt, stride_wh, H, D, H_PAD, D_PAD)
    score = _block_scores(q_HD, w_H, k_ptr + row_b.to(tl.int64) * stride_kb, stride_ks, stride_kd,
                          s0, S, D, BS, D_PAD, INTERPRETED)
    offs_s = s0 + tl.arange(0, BS)
    score = tl.where(offs_s <= pos, score, float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * S + offs_s, score, mask=offs_s < S)


def _common_args(q, k, w):
    return (q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0), k.stride(1), k.stride(2),
            w.stride(0), w.stride(1), w.stride(2))


def _pads(q):
    H, D = q.shape[2], q.shape[3]
    return dict(H=H, D=D, H_PAD=_util.next_pow2(H, 16), D_PAD=_util.next_pow2(D, 16),
                INTERPRETED=platform.triton_interpreter_enabled())  # see _block_scores


def kernel_width(topk: int, num_keys: int) -> int:
    """The top-k the kernel computes: a row never has more than S keys, so a wider ``topk`` only adds -1
    columns, and neither the scratch nor the register tile grows with it."""
    return max(1, min(topk, num_keys))


def scratch_shape(num_rows: int, topk: int, key_block: int):
    """The top-k kernel's scratch: int64 [Q, 2 * KP] (best + staging per query row).

    KP >= key_block so that one block of keys always fits the staging area after a merge."""
    return (num_rows, 2 * _util.next_pow2(topk, key_block))


def indexer_topk_and_nan_rows(q, k, w, *, topk: int, start_pos=0, config: LaunchConfig, pool: int = 1):
    """(int32 [B, T, topk] as ``dsa_indexer_topk``, int8 [B * T]: 1 where a visible score is NaN). ``pool`` > 1:
    ``k`` holds pooled keys, pool j visible to the query at position p when (j + 1) * pool - 1 <= p."""
    B, T = q.shape[:2]
    S = k.shape[1]
    width = kernel_width(topk, S)
    out = torch.empty((B, T, width), dtype=torch.int32, device=q.device)
    scratch = torch.empty(scratch_shape(B * T, width, config.block("keys")), dtype=torch.int64, device=q.device)
    nan_rows = torch.empty(B * T, dtype=torch.int8, device=q.device)
    w = w.float() if w.dtype == torch.float64 else w
    _indexer_topk_kernel[(B * T,)](
        q, k, w, _util.start_tensor(start_pos, B, q.device), out, scratch, nan_rows, T, S, width,
        *_common_args(q, k, w), BS=config.block("keys"), KP=scratch.shape[1] // 2, POOL=pool, **_pads(q),
        **config.launch_kwargs())
    if width < topk:  # columns past the key count: the contract's -1 padding
        out = torch.nn.functional.pad(out, (0, topk - width), value=-1)  # [B, T, topk]
    return out, nan_rows


def raise_if_nan(nan_rows: torch.Tensor) -> None:
    """The reference's error for NaN scores (finite inputs can overflow to inf - inf). Reading the flags is
    a device sync, so like the entry point's value checks it is skipped when they are off or compiling."""
    if torch.compiler.is_compiling() or not _checks.value_checks_enabled():  # first: dynamo folds it (no break)
        return
    if bool(nan_rows.any()):
        raise ValueError("q, k, w: indexer scores overflowed to NaN; rescale the inputs")


def indexer_topk(q, k, w, *, topk: int, start_pos=0, config: LaunchConfig):
    """The ``dsa_indexer_topk`` contract: int32 [B, T, topk]."""
    out, nan_rows = indexer_topk_and_nan_rows(q, k, w, topk=topk, start_pos=start_pos, config=config)
    raise_if_nan(nan_rows)
    return out


def kpool_topk(q, k, w, gate, ape, *, topk: int, kpool: int, select_tail: bool, scale: float, start_pos=0,
               config: LaunchConfig):
    """``dsa_kpool_topk``: the pooled keys (``kpool_topk.pool_keys``: elementwise torch ops), this module's fused
    top-k over them with POOL = kpool (pool j visible once its last token is), then the shared expansion to
    token indices and the tail."""
    B, T = q.shape[:2]
    pooled = kpool_topk_ops.pool_keys(k, gate, ape, kpool)  # [B, P, D] fp32 (the reference's), so q goes fp32
    P = pooled.shape[1]
    if P == 0:  # no complete pool yet: only the tail
        pools = torch.full((B, T, 1), -1, dtype=torch.int32, device=q.device)
    else:
        w_scaled = w.float() * scale
        pools, nan_rows = indexer_topk_and_nan_rows(q.float(), pooled, w_scaled, topk=min(topk // kpool, P),
                                                    start_pos=start_pos, config=config, pool=kpool)
        raise_if_nan(nan_rows)
    return kpool_topk_ops.expand(pools, start_pos, topk=topk, kpool=kpool, select_tail=select_tail)


def kpool_supports(q, k, w, gate, ape, *args, topk: int = None, kpool: int = 1, **kwargs):
    return supports(q, k, w, topk=None if topk is None else max(1, topk // kpool))


def indexer_scores(q, k, w, *, start_pos=0, config: LaunchConfig):
    """The ``dsa_indexer_scores`` contract: fp32 [B, T, S], -inf where not causal."""
    B, T = q.shape[:2]
    S = k.shape[1]
    BS = config.block("keys")
    out = torch.empty((B, T, S), dtype=torch.float32, device=q.device)
    w = w.float() if w.dtype == torch.float64 else w
    _indexer_scores_kernel[(B * T, triton.cdiv(S, BS))](
        q, k, w, _util.start_tensor(start_pos, B, q.device), out, T, S, *_common_args(q, k, w),
        BS=BS, **_pads(q), **config.launch_kwargs())
    return out


def supports(q, k, w, *args, topk: int = None, **kwargs):
    """Decline fp64 (its reference is the fp64 baseline), head dims too wide for one register tile, and
    a top-k whose KP-wide tile is past Triton's largest tensor."""
    why = _util.float_dtype_verdict("q", q)
    if why:
        return False, why
    if q.shape[3] > 256 or q.shape[2] > 128:
        return False, f"H={q.shape[2]} > 128 or D={q.shape[3]} > 256 does not fit one register tile"
    tile = None if topk is None else _util.next_pow2(kernel_width(topk, k.shape[1]))
    if tile is not None and tile > tl.TRITON_MAX_TENSOR_NUMEL:
        return False, f"topk={topk} (S={k.shape[1]} keys): a top-k tile of {tile} keys is past Triton's " \
                      f"{tl.TRITON_MAX_TENSOR_NUMEL}-element limit"
    return True, ""


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "indexer"  # this module's launch configuration
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=2, blocks={"keys": 64})  # unless the vendor overrides it
ITEMSIZES = (4, 2)  # fp32 and 16-bit inputs


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    BS = blocks["keys"]
    H_PAD, D_PAD = _util.next_pow2(dims.indexer_heads, 16), _util.next_pow2(dims.indexer_head_dim, 16)
    KP = _util.next_pow2(dims.index_topk, BS)
    q, k = Tile("q", (H_PAD, D_PAD), itemsize), Tile("k", (BS, D_PAD), itemsize, pipelined=True)
    dots = Tile("dots", (H_PAD, BS), 4, scratch=True)  # fp32 q . k, summed over heads
    return {
        # the bitonic merge reduces and reshapes int64 [2] * log2(KP) views of the best keys
        "indexer_topk": [q, k, dots, Tile("merge", (KP,), 8, scratch=True)],
        "indexer_scores": [q, dataclasses.replace(k, pipelined=False), dots],
    }


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    """op -> kernel (``custom_ops`` then wraps dsa_indexer_topk as a torch.library op)."""
    return {"dsa_indexer_scores": bind(indexer_scores, configs.get(FAMILY, DEFAULT_LAUNCH), supports),
            "dsa_indexer_topk": bind(indexer_topk, configs.get(FAMILY, DEFAULT_LAUNCH), supports),
            "dsa_kpool_topk": bind(kpool_topk, configs.get(FAMILY, DEFAULT_LAUNCH), kpool_supports)}
