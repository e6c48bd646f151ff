"""Backward of the grouped SwiGLU experts (``moe_experts.experts``) in Triton.

Legend: M expert-sorted rows, D hidden, F expert FFN width, E experts; BM / BN / BK tiles of the
row-tile kernels, BI / BJ / BR tiles of the weight-gradient kernel. Per expert e over its rows x:
  g = x Wg^T, u = x Wu^T, h = silu(g) * u, out = h Wd^T                               (forward)
  dh = dO Wd;  dg = dh * u * silu'(g);  du = dh * silu(g)           (pass 1, g / u recomputed)
  (``swiglu_limit`` L: g, u clamped as the forward, dg zero where g > L, du zero outside [-L, L]: torch's
  clamp gradients, the ends passing)
  dx = dg Wg + du Wu                                                                   (pass 2)
  dWd = dO^T h,  dWg = dg^T x,  dWu = du^T x                      (pass 3, sums over e's rows)
Passes 1 and 2 walk the same host-side tile schedule as the forward (one launch covers every expert);
pass 3 has one program per (expert, output tile), which walks that expert's rows in order: no atomics,
so the gradients are bitwise repeatable, and an expert with no row gets a zero gradient. All arithmetic
is fp32 with exact products (16-bit tiles are widened), like the forward and the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton.launch import LaunchConfig


@triton.jit
def _swiglu_bwd_kernel(x_ptr, dout_ptr, wg_ptr, wu_ptr, wd_ptr, h_ptr, dg_ptr, du_ptr,
                       tile_expert_ptr, tile_row0_ptr, tile_row1_ptr, F, D, limit,
                       CLAMP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Pass 1 on rows [BM] x width [BN]: h, dg, du (fp32 [M, F]); x, dO are [M, D], Wg / Wu [E, F, D], Wd [E, D, F]."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row0 = tl.load(tile_row0_ptr + tile)
    row1 = tl.load(tile_row1_ptr + tile)
    offs_m = row0 + tl.arange(0, BM)
    offs_f = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows = offs_m[:, None].to(tl.int64) * D
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    acc_dh = tl.zeros([BM, BN], tl.float32)
    w_base = e * F * D
    for k0 in range(0, D, BK):
        kk = k0 + offs_k  # hidden index d
        a_mask = (offs_m[:, None] < row1) & (kk[None, :] < D)
        w_mask = (offs_f[:, None] < F) & (kk[None, :] < D)
        x = tl.load(x_ptr + rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)  # [BM, BK]
        dout = tl.load(dout_ptr + rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)  # [BM, BK]
        fd = w_base + offs_f[:, None] * D + kk[None, :]  # Wg / Wu [f, d]
        wg = tl.load(wg_ptr + fd, mask=w_mask, other=0.0).to(tl.float32)  # [BN, BK]
        wu = tl.load(wu_ptr + fd, mask=w_mask, other=0.0).to(tl.float32)
        wd = tl.load(wd_ptr + w_base + kk[None, :] * F + offs_f[:, None], mask=w_mask,
                     other=0.0).to(tl.float32)  # Wd[d, f] as [BN (f), BK (d)]
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision="ieee")
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision="ieee")
        acc_dh = tl.dot(dout, tl.trans(wd), acc_dh, input_precision="ieee")
    if CLAMP:  # the forward's clamps, and their gradients' masks (computed on the unclamped values)
        pass_g = acc_g <= limit
        pass_u = (acc_u >= -limit) & (acc_u <= limit)
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    sig = 1.0 / (1.0 + tl.exp(-acc_g))
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # the forward's formula: the same h bitwise
    d_gate = acc_dh * acc_u * sig * (1.0 + acc_g * (1.0 - sig))  # silu'(g) = s (1 + g (1 - s))
    d_up = acc_dh * acc_g * sig
    if CLAMP:
        d_gate = tl.where(pass_g, d_gate, 0.0)
        d_up = tl.where(pass_u, d_up, 0.0)
    out_offs = offs_m[:, None].to(tl.int64) * F + offs_f[None, :]
    out_mask = (offs_m[:, None] < row1) & (offs_f[None, :] < F)
    tl.store(h_ptr + out_offs, h, mask=out_mask)
    tl.store(dg_ptr + out_offs, d_gate, mask=out_mask)
    tl.store(du_ptr + out_offs, d_up, mask=out_mask)


@triton.jit
def _grouped_dx_kernel(dg_ptr, du_ptr, wg_ptr, wu_ptr, dx_ptr, tile_expert_ptr, tile_row0_ptr, tile_row1_ptr,
                       F, D, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Pass 2 on rows [BM] x hidden [BN]: dx = dg Wg[e] + du Wu[e] (fp32 [M, D])."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    row0 = tl.load(tile_row0_ptr + tile)
    row1 = tl.load(tile_row1_ptr + tile)
    offs_m = row0 + tl.arange(0, BM)
    offs_d = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows = offs_m[:, None].to(tl.int64) * F
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, F, BK):
        kk = k0 + offs_k  # width index f
        a_mask = (offs_m[:, None] < row1) & (kk[None, :] < F)
        w_mask = (offs_d[:, None] < D) & (kk[None, :] < F)
        dg = tl.load(dg_ptr + rows + kk[None, :], mask=a_mask, other=0.0)  # [BM, BK] fp32
        du = tl.load(du_ptr + rows + kk[None, :], mask=a_mask, other=0.0)
        df = e * F * D + kk[None, :] * D + offs_d[:, None]  # W[f, d] as [BN (d), BK (f)]
        wg = tl.load(wg_ptr + df, mask=w_mask, other=0.0).to(tl.float32)
        wu = tl.load(wu_ptr + df, mask=w_mask, other=0.0).to(tl.float32)
        acc = tl.dot(dg, tl.trans(wg), acc, input_precision="ieee")
        acc = tl.dot(du, tl.trans(wu), acc, input_precision="ieee")
    tl.store(dx_ptr + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], acc,
             mask=(offs_m[:, None] < row1) & (offs_d[None, :] < D))


@triton.jit
def _grouped_wgrad_kernel(a1_ptr, a2_ptr, b_ptr, out1_ptr, out2_ptr, row_start_ptr, counts_ptr, I, J,
                          PAIR: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr):
    """Pass 3: out[e, i, j] = sum over e's rows r (in order) of a[r, i] * b[r, j]; a [M, I], b [M, J], out [E, I, J].
    With PAIR, a second product a2^T b into out2 shares the loads of b."""
    e = tl.program_id(0).to(tl.int64)
    offs_i = tl.program_id(1) * BI + tl.arange(0, BI)
    offs_j = tl.program_id(2) * BJ + tl.arange(0, BJ)
    start = tl.load(row_start_ptr + e)
    end = start + tl.load(counts_ptr + e)
    acc1 = tl.zeros([BI, BJ], tl.float32)
    acc2 = tl.zeros([BI, BJ], tl.float32)
    for r0 in range(start, end, BR):
        offs_r = r0 + tl.arange(0, BR)
        r_ok = offs_r[:, None] < end
        rows = offs_r[:, None].to(tl.int64)
        b = tl.load(b_ptr + rows * J + offs_j[None, :], mask=r_ok & (offs_j[None, :] < J), other=0.0).to(tl.float32)
        a_mask = r_ok & (offs_i[None, :] < I)
        a1 = tl.load(a1_ptr + rows * I + offs_i[None, :], mask=a_mask, other=0.0).to(tl.float32)  # [BR, BI]
        acc1 = tl.dot(tl.trans(a1), b, acc1, input_precision="ieee")
        if PAIR:
            a2 = tl.load(a2_ptr + rows * I + offs_i[None, :], mask=a_mask, other=0.0).to(tl.float32)
            acc2 = tl.dot(tl.trans(a2), b, acc2, input_precision="ieee")
    out_offs = e * I * J + offs_i[:, None] * J + offs_j[None, :]
    out_mask = (offs_i[:, None] < I) & (offs_j[None, :] < J)
    tl.store(out1_ptr + out_offs, acc1, mask=out_mask)
    if PAIR:
        tl.store(out2_ptr + out_offs, acc2, mask=out_mask)


def _weight_grads(a1, a2, b, counts, num_experts: int, config: LaunchConfig):
    """(a1^T b, a2^T b) per expert over its rows, fp32 [E, I, J] each (a2 None: the second is None)."""
    I, J = a1.shape[1], b.shape[1]
    BI, BJ, BR = config.block("m"), config.block("n"), config.block("k")
    row_start = (torch.cumsum(counts, 0) - counts).contiguous()  # [E] first row of each expert
    out1 = torch.empty((num_experts, I, J), dtype=torch.float32, device=a1.device)
    out2 = torch.empty_like(out1) if a2 is not None else out1
    _grouped_wgrad_kernel[(num_experts, triton.cdiv(I, BI), triton.cdiv(J, BJ))](
        a1, a2 if a2 is not None else a1, b, out1, out2, row_start, counts.contiguous(), I, J,
        PAIR=a2 is not None, BI=BI, BJ=BJ, BR=BR, **config.launch_kwargs())
    return out1, (out2 if a2 is not None else None)


def experts_backward(x, counts, w_gate, w_up, w_down, d_out, schedule, config: LaunchConfig,
                     limit: Optional[float] = None):
    """(dx [M, D], dWg [E, F, D], dWu [E, F, D], dWd [E, D, F]), fp32, for contiguous operands."""
    M, D = x.shape
    E, F = w_gate.shape[0], w_gate.shape[1]
    BM, BN, BK = config.block("m"), config.block("n"), config.block("k")
    n_tiles = schedule[0].numel()
    hidden = torch.empty((M, F), dtype=torch.float32, device=x.device)
    d_gate, d_up = torch.empty_like(hidden), torch.empty_like(hidden)
    dx = torch.zeros((M, D), dtype=torch.float32, device=x.device)  # rows of no tile (none today) stay 0
    if n_tiles:
        _swiglu_bwd_kernel[(n_tiles, triton.cdiv(F, BN))](
            x, d_out, w_gate, w_up, w_down, hidden, d_gate, d_up, *schedule, F, D,
            0.0 if limit is None else float(limit), CLAMP=limit is not None, BM=BM, BN=BN, BK=BK,
            **config.launch_kwargs())
        _grouped_dx_kernel[(n_tiles, triton.cdiv(D, BN))](
            d_gate, d_up, w_gate, w_up, dx, *schedule, F, D, BM=BM, BN=BN, BK=BK, **config.launch_kwargs())
    d_wg, d_wu = _weight_grads(d_gate, d_up, x, counts, E, config)
    d_wd, _ = _weight_grads(d_out, None, hidden, counts, E, config)
    return dx, d_wg, d_wu, d_wd
