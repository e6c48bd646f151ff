"""MoE dispatch (stable sort of token copies by expert) and combine (its weighted inverse), in Triton.

Legend: N tokens, K slots per token, M = N * K assignments (m = n * K + j), E experts, D hidden size.

dispatch:
  count kernel   -- one program per expert counts its assignments;
  place kernel   -- one program per expert walks the assignments in order and writes each of its
                    own to ``offsets[e] + (number of earlier ones)``: a stable counting sort, no atomics;
  gather kernel  -- x_sorted[r] = x[sort_idx[r] // K].
combine: out[n] = sum_j w[n, j] * y_sorted[inverse[n * K + j]], in slot order, fp32 accumulation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util
from glm5_core.backends.triton.launch import LaunchConfig


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, M, BR: tl.constexpr):
    e = tl.program_id(0)
    total = tl.zeros([], tl.int64)
    for m0 in range(0, M, BR):
        offs = m0 + tl.arange(0, BR)
        ids = tl.load(ids_ptr + offs, mask=offs < M, other=-1)
        total += tl.sum((ids == e).to(tl.int64), axis=0)
    tl.store(counts_ptr + e, total)


@triton.jit
def _place_kernel(ids_ptr, offsets_ptr, sort_idx_ptr, M, BR: tl.constexpr):
    e = tl.program_id(0)
    next_slot = tl.load(offsets_ptr + e)
    for m0 in range(0, M, BR):
        offs = m0 + tl.arange(0, BR)
        mine = tl.load(ids_ptr + offs, mask=offs < M, other=-1) == e
        rank = tl.cumsum(mine.to(tl.int64), axis=0) - 1
        tl.store(sort_idx_ptr + next_slot + rank, offs.to(tl.int64), mask=mine)
        next_slot += tl.sum(mine.to(tl.int64), axis=0)


@triton.jit
def _gather_rows_kernel(x_ptr, sort_idx_ptr, out_ptr, M, D, K, stride_x, BR: tl.constexpr, BD: tl.constexpr):
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    src = tl.load(sort_idx_ptr + offs_r, mask=offs_r < M, other=0) // K
    mask = (offs_r[:, None] < M) & (offs_d[None, :] < D)
    rows = tl.load(x_ptr + src[:, None] * stride_x + offs_d[None, :], mask=mask)
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * D + offs_d[None, :], rows, mask=mask)


@triton.jit
def _combine_kernel(y_ptr, inverse_ptr, w_ptr, out_ptr, D, K, BD: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    acc = tl.zeros([BD], tl.float32)
    for j in range(0, K):  # fixed slot order
        r = tl.load(inverse_ptr + n * K + j).to(tl.int64)  # int32 sort_idx: r * D can pass 2^31
        w = tl.load(w_ptr + n * K + j).to(tl.float32)
        acc += w * tl.load(y_ptr + r * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * D + offs_d, acc.to(out_ptr.dtype.element_ty), mask=offs_d < D)


_GATHER_ROWS = 16


def dispatch(x, expert_ids, *, num_experts: int, config: LaunchConfig):
    """``moe_dispatch``: (x_sorted [M, D], sort_idx int64 [M], counts int64 [E])."""
    N, K = expert_ids.shape
    D = x.shape[1]
    M = N * K
    ids = expert_ids.reshape(-1).contiguous()  # [M]
    x = x if x.stride(1) == 1 else x.contiguous()
    BR, BD = config.block("rows"), config.block("cols")
    counts = torch.empty(num_experts, dtype=torch.int64, device=x.device)
    _count_kernel[(num_experts,)](ids, counts, M, BR=BR, **config.launch_kwargs())
    offsets = (torch.cumsum(counts, 0) - counts).contiguous()  # exclusive prefix sum [E]
    sort_idx = torch.empty(M, dtype=torch.int64, device=x.device)
    _place_kernel[(num_experts,)](ids, offsets, sort_idx, M, BR=BR, **config.launch_kwargs())
    x_sorted = torch.empty((M, D), dtype=x.dtype, device=x.device)
    if M and D:
        _gather_rows_kernel[(triton.cdiv(M, _GATHER_ROWS), triton.cdiv(D, BD))](
            x, sort_idx, x_sorted, M, D, K, x.stride(0), BR=_GATHER_ROWS, BD=BD, **config.launch_kwargs())
    return x_sorted, sort_idx, counts


def combine(y_sorted, sort_idx, weights, *, config: LaunchConfig):
    """``moe_combine``: out [N, D] in y_sorted's dtype."""
    N, K = weights.shape
    D = y_sorted.shape[1]
    inverse = torch.empty_like(sort_idx)
    inverse[sort_idx] = torch.arange(sort_idx.numel(), device=sort_idx.device, dtype=sort_idx.dtype)
    out = torch.empty((N, D), dtype=y_sorted.dtype, device=y_sorted.device)
    if N and D:
        BD = config.block("cols")
        _combine_kernel[(N, triton.cdiv(D, BD))](y_sorted.contiguous(), inverse, weights.contiguous(), out, D, K,
                                                BD=BD, **config.launch_kwargs())
    return out


def combine_supports(y_sorted, sort_idx, weights, **kwargs):
    why = _util.float_dtype_verdict("y_sorted", y_sorted) or _util.float_dtype_verdict("weights", weights)
    return (False, why) if why else (True, "")
