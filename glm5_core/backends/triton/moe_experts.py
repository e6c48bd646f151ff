"""Grouped-GEMM SwiGLU experts in Triton: every expert's contiguous rows through its own weights.

Legend: M expert-sorted rows, D hidden, F expert FFN width, E experts; BM / BN / BK tiles.

A host-side schedule lists the row tiles of every expert (expert id, first row, end row), so one
launch covers all experts with no padding of the token dimension:
  pass 1 (SWIGLU):  hidden[M, F] = silu(x @ Wg[e]^T) * (x @ Wu[e]^T)      fp32
                    (with GLM-5.3's ``swiglu_limit`` L: silu(min(g, L)) * clamp(u, -L, L); CLAMP constexpr)
  pass 2:           out[M, D]    = hidden @ Wd[e]^T
Both passes are the same kernel (``_grouped_gemm_kernel``), with or without the gated pair.
Accumulation is fp32 with exact fp32 products (16-bit tiles are widened), like the reference.
``_GroupedSwiGLU`` makes it differentiable: the backward (``moe_experts_bwd``) recomputes the gated pair
and gives the gradients of the rows and of the three weight stacks.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util, moe_experts_bwd
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.kernel import Kernel


@triton.jit
def _grouped_gemm_kernel(a_ptr, b1_ptr, b2_ptr, out_ptr, tile_expert_ptr, tile_row0_ptr, tile_row1_ptr,
                         NOUT, KDIM, stride_am, stride_be, stride_bn, stride_om, limit,
                         SWIGLU: tl.constexpr, CLAMP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row0 = tl.load(tile_row0_ptr + tile)
    row1 = tl.load(tile_row1_ptr + tile)
    offs_m = row0 + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    acc1 = tl.zeros([BM, BN], tl.float32)
    acc2 = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, KDIM, BK):
        kk = k0 + offs_k
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + kk[None, :],
                    mask=(offs_m[:, None] < row1) & (kk[None, :] < KDIM), other=0.0).to(tl.float32)
        b_offs = e * stride_be + offs_n[:, None] * stride_bn + kk[None, :]
        b_mask = (offs_n[:, None] < NOUT) & (kk[None, :] < KDIM)
        b1 = tl.load(b1_ptr + b_offs, mask=b_mask, other=0.0).to(tl.float32)
        acc1 = tl.dot(a, tl.trans(b1), acc1, input_precision="ieee")
        if SWIGLU:
            b2 = tl.load(b2_ptr + b_offs, mask=b_mask, other=0.0).to(tl.float32)
            acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision="ieee")
    if SWIGLU:
        if CLAMP:  # transformers' gate.clamp(max=L), up.clamp(-L, L)
            acc1 = tl.minimum(acc1, limit)
            acc2 = tl.minimum(tl.maximum(acc2, -limit), limit)
        acc1 = acc1 / (1.0 + tl.exp(-acc1)) * acc2  # silu(gate) * up
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc1,
             mask=(offs_m[:, None] < row1) & (offs_n[None, :] < NOUT))


def tile_schedule(counts: torch.Tensor, block_m: int):
    """(expert, first row, end row) int32 [n_tiles] each: the BM-row tiles of every expert, in order."""
    experts, row0s, row1s = [], [], []
    start = 0
    for e, n in enumerate(counts.tolist()):
        for r in range(start, start + n, block_m):
            experts.append(e)
            row0s.append(r)
            row1s.append(start + n)
        start += n
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=counts.device)  # noqa: E731
    return as_tensor(experts), as_tensor(row0s), as_tensor(row1s)


def _launch(a, b1, b2, out, schedule, config: LaunchConfig, swiglu: bool, limit: Optional[float] = None):
    BM, BN, BK = config.block("m"), config.block("n"), config.block("k")
    n_out, k_dim = b1.shape[1], b1.shape[2]
    _grouped_gemm_kernel[(schedule[0].numel(), triton.cdiv(n_out, BN))](
        a, b1, b2, out, *schedule, n_out, k_dim, a.stride(0), b1.stride(0), b1.stride(1), out.stride(0),
        0.0 if limit is None else float(limit), SWIGLU=swiglu, CLAMP=limit is not None, BM=BM, BN=BN, BK=BK,
        **config.launch_kwargs())


def _forward(x, counts, w_gate, w_up, w_down, schedule, config: LaunchConfig, limit: Optional[float] = None):
    """fp32 [M, D] for contiguous operands."""
    M, D = x.shape
    F = w_gate.shape[1]
    out = torch.zeros((M, D), dtype=torch.float32, device=x.device)
    if schedule[0].numel() == 0:
        return out
    hidden = torch.empty((M, F), dtype=torch.float32, device=x.device)
    _launch(x, w_gate, w_up, hidden, schedule, config, swiglu=True, limit=limit)
    _launch(hidden, w_down, w_down, out, schedule, config, swiglu=False)
    return out


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sorted, counts, w_gate, w_up, w_down, config, limit):
        x, w_gate_c, w_up_c, w_down_c = (t.contiguous() for t in (x_sorted, w_gate, w_up, w_down))
        schedule = tile_schedule(counts, config.block("m"))
        ctx.save_for_backward(x, counts, w_gate_c, w_up_c, w_down_c, *schedule)
        ctx.config, ctx.limit = config, limit
        ctx.dtypes = (x_sorted.dtype, w_gate.dtype, w_up.dtype, w_down.dtype)
        return _forward(x, counts, w_gate_c, w_up_c, w_down_c, schedule, config, limit).to(x_sorted.dtype)

    @staticmethod
    def backward(ctx, d_out):
        x, counts, w_gate, w_up, w_down, *schedule = ctx.saved_tensors
        dx, d_wg, d_wu, d_wd = moe_experts_bwd.experts_backward(
            x, counts, w_gate, w_up, w_down, d_out.contiguous(), schedule, ctx.config, ctx.limit)
        x_dt, wg_dt, wu_dt, wd_dt = ctx.dtypes
        return dx.to(x_dt), None, d_wg.to(wg_dt), d_wu.to(wu_dt), d_wd.to(wd_dt), None, None


def experts(x_sorted, counts, w_gate, w_up, w_down, *, config: LaunchConfig, swiglu_limit: Optional[float] = None):
    """``moe_experts``: [M, D] in x_sorted's dtype; differentiable in x_sorted and the three weight stacks
    (``swiglu_limit``: the clamped SwiGLU, the clamps' gradients included)."""
    return _GroupedSwiGLU.apply(x_sorted, counts, w_gate, w_up, w_down, config, swiglu_limit)


def supports(x_sorted, counts, w_gate, w_up, w_down, **kwargs):
    why = _util.float_dtype_verdict("x_sorted", x_sorted)
    return (False, why) if why else (True, "")


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "moe_experts"  # this module's and moe_experts_bwd's launch configuration
# the launch unless the vendor overrides it
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=3, blocks={"m": 64, "n": 64, "k": 32})
ITEMSIZES = (4,)  # every tile is widened to fp32 before its dot, whatever the input dtype


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
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


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    return {"moe_experts": bind(experts, configs.get(FAMILY, DEFAULT_LAUNCH), supports,
                                differentiable=True)}  # backward through _GroupedSwiGLU (moe_experts_bwd)
