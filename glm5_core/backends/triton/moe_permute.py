"""MoE dispatch (stable sort of token copies by expert) and combine (its weighted inverse), in Triton.

Legend: N tokens, K slots per token, M = N * K assignments (m = n * K + j), E experts, D hidden size.

dispatch:
  count kernel   -- one program per expert counts its assignments;
  place kernel   -- one program per expert walks the assignments in order and writes each of its
                    own to ``offsets[e] + (number of earlier ones)``: a stable counting sort, no atomics;
  gather kernel  -- x_sorted[r] = x[sort_idx[r] // K].
combine: out[n] = sum_j w[n, j] * y_sorted[inverse[n * K + j]], in slot order, fp32 accumulation.

Both are differentiable (``_Dispatch``, ``_Combine``), with backwards made of the same kernels, no atomics:
  dispatch:  dx[n] = sum_j d_x_sorted[inverse[n * K + j]]          (the combine kernel, unit weights)
  combine:   d_y_sorted[r] = w[m] * d_out[m // K] with m = sort_idx[r]       (the gather kernel, weighted)
             d_w[n, j] = d_out[n] . y_sorted[inverse[n * K + j]]       (one program per token)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.kernel import Kernel


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
def _gather_rows_kernel(x_ptr, sort_idx_ptr, w_ptr, out_ptr, M, D, K, stride_x, WEIGHTED: tl.constexpr,
                        BR: tl.constexpr, BD: tl.constexpr):
    """out[r] = x[sort_idx[r] // K], times w[sort_idx[r]] (fp32) when WEIGHTED."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    slot = tl.load(sort_idx_ptr + offs_r, mask=offs_r < M, other=0)
    src = slot // K
    mask = (offs_r[:, None] < M) & (offs_d[None, :] < D)
    rows = tl.load(x_ptr + src[:, None] * stride_x + offs_d[None, :], mask=mask)
    if WEIGHTED:
        w = tl.load(w_ptr + slot, mask=offs_r < M, other=0.0).to(tl.float32)
        rows = (rows.to(tl.float32) * w[:, None]).to(out_ptr.dtype.element_ty)
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


@triton.jit
def _combine_weight_grad_kernel(y_ptr, inverse_ptr, dout_ptr, dw_ptr, D, K, BD: tl.constexpr):
    """d_w[n, j] = d_out[n] . y[inverse[n * K + j]] (fp32), one program per token, hidden tiles in order."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    for j in range(0, K):
        r = tl.load(inverse_ptr + n * K + j).to(tl.int64)
        acc = tl.zeros([BD], tl.float32)
        for d0 in range(0, D, BD):
            dd = d0 + offs
            y = tl.load(y_ptr + r * D + dd, mask=dd < D, other=0.0).to(tl.float32)
            acc += y * tl.load(dout_ptr + n * D + dd, mask=dd < D, other=0.0).to(tl.float32)
        tl.store(dw_ptr + n * K + j, tl.sum(acc, axis=0))


_GATHER_ROWS = 16


def _inverse(sort_idx):
    """inverse[m] = the sorted row of flat assignment m (sort_idx's dtype)."""
    inverse = torch.empty_like(sort_idx)
    inverse[sort_idx] = torch.arange(sort_idx.numel(), device=sort_idx.device, dtype=sort_idx.dtype)
    return inverse


def _gather(x, sort_idx, weights, K: int, out_dtype, config: LaunchConfig):
    """[M, D]: rows of x [N, D] (stride(1) == 1) in sorted order, scaled by weights [M] when given."""
    M, D = sort_idx.numel(), x.shape[1]
    out = torch.empty((M, D), dtype=out_dtype, device=x.device)
    if M and D:
        BD = config.block("cols")
        _gather_rows_kernel[(triton.cdiv(M, _GATHER_ROWS), triton.cdiv(D, BD))](
            x, sort_idx, weights if weights is not None else x, out, M, D, K, x.stride(0),
            WEIGHTED=weights is not None, BR=_GATHER_ROWS, BD=BD, **config.launch_kwargs())
    return out


def _combine_rows(y_sorted, inverse, weights, config: LaunchConfig):
    """out [N, D] in y_sorted's dtype: the weighted slot sums (y_sorted, weights contiguous)."""
    N, K = weights.shape
    D = y_sorted.shape[1]
    out = torch.empty((N, D), dtype=y_sorted.dtype, device=y_sorted.device)
    if N and D:
        BD = config.block("cols")
        _combine_kernel[(N, triton.cdiv(D, BD))](y_sorted, inverse, weights, out, D, K, BD=BD,
                                                **config.launch_kwargs())
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expert_ids, num_experts, config):
        x_sorted, sort_idx, counts = _dispatch(x, expert_ids, num_experts, config)
        ctx.mark_non_differentiable(sort_idx, counts)
        ctx.save_for_backward(sort_idx)
        ctx.tokens_slots, ctx.config = tuple(expert_ids.shape), config  # (N, K)
        return x_sorted, sort_idx, counts

    @staticmethod
    def backward(ctx, d_x_sorted, _d_sort_idx, _d_counts):
        (sort_idx,) = ctx.saved_tensors
        N, K = ctx.tokens_slots
        D = d_x_sorted.shape[1]
        inverse = _inverse(sort_idx)
        if d_x_sorted.dtype == torch.float64:  # the combine kernel accumulates in fp32: sum fp64 in torch
            return d_x_sorted[inverse].view(N, K, D).sum(1), None, None, None  # [N, K, D] -> [N, D]
        ones = torch.ones((N, K), dtype=torch.float32, device=d_x_sorted.device)
        return _combine_rows(d_x_sorted.contiguous(), inverse, ones, ctx.config), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted, sort_idx, weights, config):
        y_sorted, weights_c = y_sorted.contiguous(), weights.contiguous()
        inverse = _inverse(sort_idx)
        ctx.save_for_backward(y_sorted, sort_idx, inverse, weights_c)
        ctx.config, ctx.w_dtype = config, weights.dtype
        return _combine_rows(y_sorted, inverse, weights_c, config)

    @staticmethod
    def backward(ctx, d_out):
        y_sorted, sort_idx, inverse, weights = ctx.saved_tensors
        N, K = weights.shape
        D = y_sorted.shape[1]
        d_out = d_out.contiguous()
        d_y = _gather(d_out, sort_idx, weights.view(-1), K, y_sorted.dtype, ctx.config)
        d_w = torch.zeros((N, K), dtype=torch.float32, device=d_out.device)
        if N and K and D:
            _combine_weight_grad_kernel[(N,)](y_sorted, inverse, d_out, d_w, D, K, BD=ctx.config.block("cols"),
                                              **ctx.config.launch_kwargs())
        return d_y, None, d_w.to(ctx.w_dtype), None


def _dispatch(x, expert_ids, num_experts: int, config: LaunchConfig):
    N, K = expert_ids.shape
    M = N * K
    ids = expert_ids.reshape(-1).contiguous()  # [M]
    x = x if x.stride(1) == 1 else x.contiguous()
    BR = config.block("rows")
    counts = torch.empty(num_experts, dtype=torch.int64, device=x.device)
    _count_kernel[(num_experts,)](ids, counts, M, BR=BR, **config.launch_kwargs())
    offsets = (torch.cumsum(counts, 0) - counts).contiguous()  # exclusive prefix sum [E]
    sort_idx = torch.empty(M, dtype=torch.int64, device=x.device)
    _place_kernel[(num_experts,)](ids, offsets, sort_idx, M, BR=BR, **config.launch_kwargs())
    return _gather(x, sort_idx, None, K, x.dtype, config), sort_idx, counts


def dispatch(x, expert_ids, *, num_experts: int, config: LaunchConfig):
    """``moe_dispatch``: (x_sorted [M, D], sort_idx int64 [M], counts int64 [E]); differentiable in x."""
    return _Dispatch.apply(x, expert_ids, num_experts, config)


def combine(y_sorted, sort_idx, weights, *, config: LaunchConfig):
    """``moe_combine``: out [N, D] in y_sorted's dtype; differentiable in y_sorted and weights."""
    return _Combine.apply(y_sorted, sort_idx, weights, config)


def combine_supports(y_sorted, sort_idx, weights, **kwargs):
    why = _util.float_dtype_verdict("y_sorted", y_sorted) or _util.float_dtype_verdict("weights", weights)
    return (False, why) if why else (True, "")


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "moe_permute"  # this module's launch configuration
# the launch unless the vendor overrides it
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 256, "cols": 128})
ITEMSIZES = (4,)


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    BR, BD = blocks["rows"], blocks["cols"]
    return {
        "count": [Tile("ids", (BR,), 8, scratch=True)],
        "place": [Tile("ids", (BR,), 8, scratch=True)],  # cumsum
        "gather_rows": [],
        "combine": [],
        "combine_weight_grad": [Tile("acc", (BD,), 4, scratch=True)],
    }


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    """op -> kernel: this module serves both halves of the permutation (backwards: _Dispatch / _Combine)."""
    config = configs.get(FAMILY, DEFAULT_LAUNCH)
    return {"moe_dispatch": bind(dispatch, config, differentiable=True),
            "moe_combine": bind(combine, config, combine_supports, differentiable=True)}
