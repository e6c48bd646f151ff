"""KDA's backward in Triton: the reverse-time recurrence (gradients of q, k, v, g, beta and the initial state) and
the short causal conv's (x, weight, bias, conv state). ``kda.py`` pairs them with its forwards in autograd
Functions and launches both with the ``kda`` family's configuration.

Legend as in ``glm5_core.ops.kda``: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V];
BK = next power of two >= K, BV value columns per program (the ``v_bwd`` block),
NV = cdiv(V, BV) column blocks, CK tokens per checkpoint (the ``checkpoint`` block), N = cdiv(T, CK) checkpoints.

The recurrence per token (q already normalised and scaled, k normalised, a = exp(g)):
  S' = diag(a) S_prev,  p = S'^T k,  u = beta (v - p),  S = S' + k u^T,  o = S^T q.
Walked back with dS the gradient of the state after the token (from the later tokens and the final state):
  dS += q do^T;  dq = S do;  dk = dS u;  du = dS^T k;  dv = beta du;  dbeta = <du, v - p>;  dp = -beta du;
  dS' = dS + k dp^T;  dk += S' dp;  dg = rowsum(dS' * S') (d/dg of exp(g) S_prev);  dS_prev = a dS'.

``_recurrent_bwd_kernel``: one program per (batch row, head, BV value columns), as the forward: the columns of the
state evolve independently, so each program owns its [BK, BV] slice, fp32, in registers. It needs the state
entering every token in reverse order, which the forward does not keep; the program
  1. runs the recurrence forward once, storing the state entering every CK-th token (a checkpoint, fp32
     [N, BK, BV] per program in a scratch buffer);
  2. walks the checkpoints back: from checkpoint n it reruns the (at most CK) tokens of that segment forward,
     storing the state entering each in a second scratch ([CK, BK, BV] per program, reused by every segment),
     then walks those tokens back, each step re-deriving S', p, u and S from the stored S_prev (the same fp32
     operations in the same order as the forward: the same bits, whatever CK).

The dq, dk, dg, dbeta of a token sum over the value columns, so over the NV programs of its head: each program
writes its partial (fp32, [NV, pairs, T, K] / [NV, pairs, T]); ``_recurrent_bwd_reduce_kernel`` (one program per
(pair, BR tokens)) adds the NV partials in block order, then applies the scale and the L2 norm's backward
(dx = (dy - y <dy, y>) / n, y = x / n, n = sqrt(sum x^2 + eps), recomputed from the inputs) and casts to each
input's dtype. No atomics: the gradients are the same bits run to run.

Memory / time: nothing but the inputs is saved between forward and backward. While the backward runs, each
(batch row, head) pair takes fp32 scratch of NV (N + CK) BK BV (checkpoints and one segment: about
(T / CK + CK) K V) plus NV T (3 K + 1) (the partials); the pairs run in launches of as many as fit
``SCRATCH_BUDGET_BYTES`` (2 GiB: ``pairs_per_launch``), so the scratch is bounded whatever B and H (at T = 4096,
K = V = 128, BV = 16: 58 MiB a pair, 35 pairs = 280 programs a launch, about what an H100 runs at once: two of
these 128-thread, 251-register programs an SM, 132 SMs; a smaller budget splits into more, less full launches).
Time: the recurrence three times (forward, checkpoint pass, segment reruns) and the reverse step (about 2.5
forward steps of work): ~4.5 forward passes, sequential in T inside a program, like the forward. A larger CK
trades scratch (CK K V a pair) for fewer checkpoints (T / CK K V); neither CK nor the launch split changes the
result. A tensor-core chunked backward (FLA's WY form) would be faster on long sequences; it is not built here.

The conv (out = act(z), z = bias + sum_w weight[:, w] x_{t - W + 1 + w}, x_{<0} from the state):
``_conv_bwd_dz_kernel`` (one program per (batch row, BT tokens, BD channels)) recomputes z, writes dz = dout
act'(z) (fp32 [B, T, D]) and its block's partials of dweight (sum_t dz_t x_{t - W + 1 + w}) and dbias (sum_t
dz_t) (fp32 [B cdiv(T, BT), D, W] / [.., D]; summed over the blocks afterwards in order, by torch's reduction:
no atomics); ``_conv_bwd_dx_kernel`` (one program per (batch row, BT positions, BD channels) over the T + W - 1
positions of [state, x]) gathers d[state, x]_j = sum_w weight[:, w] dz_{j - w}, writing the first W - 1 positions
to the conv state's gradient and the rest to x's.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util
from glm5_core.backends.triton.launch import LaunchConfig
from glm5_core.ops import kda as ops

# fp32 scratch one launch of the recurrence's backward may take (checkpoints, a segment, the value-block
# partials); more (batch row, head) pairs than fit run in successive launches
SCRATCH_BUDGET_BYTES = 2 << 30


@triton.jit
def _token(k_ptr, g_ptr, v_ptr, beta_ptr, row, K, V, offs_k, offs_v, mk, mv, eps, L2NORM: tl.constexpr):
    """Token ``row``'s (k, L2-normalised when asked; its decay exp(g); v; beta), in fp32: what :func:`_step` takes
    (the forward kernel in ``kda.py`` reads its tokens through it too)."""
    k = tl.load(k_ptr + row * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row).to(tl.float32)
    if L2NORM:
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    return k, tl.exp(g), v, beta


@triton.jit
def _step(S, k, v, a, beta):
    """One token forward from S_prev: (S', p, u, S) (the forward kernel in ``kda.py`` steps through it too)."""
    Sp = S * a[:, None]
    p = tl.sum(Sp * k[:, None], axis=0)
    u = beta * (v - p)
    return Sp, p, u, Sp + k[:, None] * u[None, :]


@triton.jit
def _recurrent_bwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, do_ptr, dsT_ptr, ckpt_ptr, seg_ptr,
                          dq_ptr, dk_ptr, dg_ptr, dbeta_ptr, dv_ptr, ds0_ptr, bh0, NBH, T, H, K, V, NV, NCK, scale,
                          eps, HAS_S0: tl.constexpr, HAS_DST: tl.constexpr, L2NORM: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, CK: tl.constexpr):
    lbh = tl.program_id(0).to(tl.int64)  # this launch covers (batch row, head) pairs bh0 .. bh0 + NBH - 1
    bh = bh0 + lbh
    vb = tl.program_id(1)
    b = bh // H
    h = bh % H
    prog = lbh * NV + vb  # this program's scratch slices
    part_base = (vb * NBH + lbh) * T  # its partials: [NV, NBH, T, .] (block, pair, token)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    m2 = mk[:, None] & mv[None, :]
    s_off = bh * K * V + offs_k[:, None] * V + offs_v[None, :]
    tile = offs_k[:, None] * BV + tl.arange(0, BV)[None, :]  # a dense [BK, BV] slot of the scratch
    ckpt_base = ckpt_ptr + prog * NCK * BK * BV
    seg_base = seg_ptr + prog * CK * BK * BV
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], tl.float32)
    # 1. forward once, keeping the state entering every CK-th token
    for n in range(NCK):
        tl.store(ckpt_base + n * BK * BV + tile, S)
        t1 = tl.minimum(n * CK + CK, T)
        for t in range(n * CK, t1):
            row = (b * T + t) * H + h
            k, a, v, beta = _token(k_ptr, g_ptr, v_ptr, beta_ptr, row, K, V, offs_k, offs_v, mk, mv, eps, L2NORM)
            Sp, p, u, S = _step(S, k, v, a, beta)
    tl.debug_barrier()
    # 2. the segments backwards
    if HAS_DST:
        dS = tl.load(dsT_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], tl.float32)
    for nn in range(NCK):
        n = NCK - 1 - nn
        t0 = n * CK
        t1 = tl.minimum(t0 + CK, T)
        S = tl.load(ckpt_base + n * BK * BV + tile)
        for t in range(t0, t1):  # rerun the segment, keeping the state entering each token
            tl.store(seg_base + (t - t0) * BK * BV + tile, S)
            row = (b * T + t) * H + h
            k, a, v, beta = _token(k_ptr, g_ptr, v_ptr, beta_ptr, row, K, V, offs_k, offs_v, mk, mv, eps, L2NORM)
            Sp, p, u, S = _step(S, k, v, a, beta)
        tl.debug_barrier()
        for tt in range(0, t1 - t0):
            t = t1 - 1 - tt
            row = (b * T + t) * H + h
            q = tl.load(q_ptr + row * K + offs_k, mask=mk, other=0.0).to(tl.float32)
            k, a, v, beta = _token(k_ptr, g_ptr, v_ptr, beta_ptr, row, K, V, offs_k, offs_v, mk, mv, eps, L2NORM)
            do = tl.load(do_ptr + row * V + offs_v, mask=mv, other=0.0).to(tl.float32)
            if L2NORM:
                q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
            q = q * scale
            S_prev = tl.load(seg_base + (t - t0) * BK * BV + tile)
            Sp, p, u, S = _step(S_prev, k, v, a, beta)
            dS = dS + q[:, None] * do[None, :]
            dq = tl.sum(S * do[None, :], axis=1)
            dk = tl.sum(dS * u[None, :], axis=1)
            du = tl.sum(dS * k[:, None], axis=0)
            dv = beta * du
            dbeta = tl.sum(tl.where(mv, du * (v - p), 0.0), axis=0)
            dp = -beta * du
            dS = dS + k[:, None] * dp[None, :]
            dk = dk + tl.sum(Sp * dp[None, :], axis=1)
            dg = tl.sum(dS * Sp, axis=1)
            dS = dS * a[:, None]
            part = part_base + t
            tl.store(dq_ptr + part * K + offs_k, dq, mask=mk)
            tl.store(dk_ptr + part * K + offs_k, dk, mask=mk)
            tl.store(dg_ptr + part * K + offs_k, dg, mask=mk)
            tl.store(dbeta_ptr + part, dbeta)
            tl.store(dv_ptr + row * V + offs_v, dv.to(dv_ptr.dtype.element_ty), mask=mv)
        tl.debug_barrier()  # the segment scratch is rewritten by the next segment
    if HAS_S0:
        tl.store(ds0_ptr + s_off, dS, mask=m2)


@triton.jit
def _l2norm_bwd(x, dy, eps, L2NORM: tl.constexpr):
    """[BR, BK] rows: d x of y = x / sqrt(sum x^2 + eps) given d y (identity without L2NORM)."""
    if L2NORM:
        n = tl.sqrt(tl.sum(x * x, axis=1) + eps)[:, None]
        y = x / n
        return (dy - y * tl.sum(dy * y, axis=1)[:, None]) / n
    else:
        return dy


@triton.jit
def _recurrent_bwd_reduce_kernel(q_ptr, k_ptr, dq_part_ptr, dk_part_ptr, dg_part_ptr, dbeta_part_ptr,
                                 dq_ptr, dk_ptr, dg_ptr, dbeta_ptr, bh0, NBH, T, H, K, NV, scale, eps,
                                 L2NORM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    lbh = tl.program_id(0).to(tl.int64)
    bh = bh0 + lbh
    offs_t = tl.program_id(1) * BR + tl.arange(0, BR)
    offs_k = tl.arange(0, BK)
    mr = offs_t < T
    m2 = mr[:, None] & (offs_k[None, :] < K)
    rows = ((bh // H) * T + offs_t) * H + bh % H  # the tokens' rows of [B, T, H, .]
    offs = rows[:, None] * K + offs_k[None, :]
    dq = tl.zeros([BR, BK], tl.float32)
    dk = tl.zeros([BR, BK], tl.float32)
    dg = tl.zeros([BR, BK], tl.float32)
    dbeta = tl.zeros([BR], tl.float32)
    for i in range(NV):  # the value-column blocks in order
        part = (i * NBH + lbh) * T + offs_t
        p2 = part[:, None] * K + offs_k[None, :]
        dq += tl.load(dq_part_ptr + p2, mask=m2, other=0.0)
        dk += tl.load(dk_part_ptr + p2, mask=m2, other=0.0)
        dg += tl.load(dg_part_ptr + p2, mask=m2, other=0.0)
        dbeta += tl.load(dbeta_part_ptr + part, mask=mr, other=0.0)
    q = tl.load(q_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    dq = _l2norm_bwd(q, dq * scale, eps, L2NORM)
    dk = _l2norm_bwd(k, dk, eps, L2NORM)
    tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=m2)
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=m2)
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=m2)
    tl.store(dbeta_ptr + rows, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mr)


def pairs_per_launch(T: int, K: int, V: int, pairs: int, config: LaunchConfig,
                     budget: int = SCRATCH_BUDGET_BYTES) -> int:
    """How many (batch row, head) pairs one launch of the backward covers: as many as keep its fp32 scratch
    (checkpoints, one segment, the partials) within ``budget`` bytes, at least one."""
    BK, CK = _util.next_pow2(K), config.block("checkpoint")
    BV = min(config.block("v_bwd"), _util.next_pow2(V))
    NV = triton.cdiv(V, BV)
    per_pair = 4 * NV * ((triton.cdiv(T, CK) + CK) * BK * BV + T * (3 * K + 1))
    return max(1, min(pairs, budget // per_pair))


def recurrent_backward(q, k, v, g, beta, initial_state: Optional[torch.Tensor], d_o: Optional[torch.Tensor],
                       d_state: Optional[torch.Tensor], *, scale: float, use_qk_l2norm: bool,
                       config: LaunchConfig, scratch_budget: int = SCRATCH_BUDGET_BYTES):
    """Gradients (dq, dk, dv, dg, dbeta, d initial_state or None), each in its input's dtype (the state's fp32).
    ``d_o`` / ``d_state`` None: that output carries no gradient. Inputs contiguous."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    dev = q.device
    d_s0 = None
    if T == 0:
        if initial_state is not None:
            d_s0 = d_state.clone() if d_state is not None else torch.zeros_like(initial_state)
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), d_s0)
    if d_o is None:
        d_o = torch.zeros_like(v)
    d_o = d_o.contiguous()
    BK, CK, BR = _util.next_pow2(K), config.block("checkpoint"), config.block("rows")
    BV = min(config.block("v_bwd"), _util.next_pow2(V))
    NV, NCK = triton.cdiv(V, BV), triton.cdiv(T, CK)
    NBH = pairs_per_launch(T, K, V, B * H, config, scratch_budget)
    f32 = dict(dtype=torch.float32, device=dev)
    ckpt = torch.empty((NBH * NV, NCK, BK, BV), **f32)
    seg = torch.empty((NBH * NV, CK, BK, BV), **f32)
    dq_part, dk_part, dg_part = (torch.empty((NV, NBH, T, K), **f32) for _ in range(3))
    dbeta_part = torch.empty((NV, NBH, T), **f32)
    dv = torch.empty_like(v)
    if initial_state is not None:
        d_s0 = torch.empty((B, H, K, V), **f32)
    dst = d_state.contiguous() if d_state is not None else None
    dq, dk, dg, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g), torch.empty_like(beta)
    for bh0 in range(0, B * H, NBH):  # the launches reuse the scratch, one after the other on the stream
        n = min(NBH, B * H - bh0)
        _recurrent_bwd_kernel[(n, NV)](
            q, k, v, g, beta, initial_state if initial_state is not None else q, d_o, dst if dst is not None else q,
            ckpt, seg, dq_part, dk_part, dg_part, dbeta_part, dv, d_s0 if d_s0 is not None else q, bh0, NBH, T, H,
            K, V, NV, NCK, float(scale), ops.L2NORM_EPS, HAS_S0=initial_state is not None, HAS_DST=dst is not None,
            L2NORM=use_qk_l2norm, BK=BK, BV=BV, CK=CK, **config.launch_kwargs())
        _recurrent_bwd_reduce_kernel[(n, triton.cdiv(T, BR))](
            q, k, dq_part, dk_part, dg_part, dbeta_part, dq, dk, dg, dbeta, bh0, NBH, T, H, K, NV, float(scale),
            ops.L2NORM_EPS, L2NORM=use_qk_l2norm, BR=BR, BK=BK, **config.launch_kwargs())
    return dq, dk, dv, dg, dbeta, d_s0


# --------------------------------------------------------------------------------------------- the conv
@triton.jit
def _conv_bwd_dz_kernel(x_ptr, w_ptr, b_ptr, s_ptr, do_ptr, dz_ptr, dw_part_ptr, db_part_ptr, T, D, NT,
                        HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1)
    offs_t = tb * BT + tl.arange(0, BT)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    mt = offs_t < T
    md = offs_d < D
    m2 = mt[:, None] & md[None, :]
    acc = tl.zeros([BT, BD], tl.float32)
    for tap in tl.static_range(W):  # z as the forward sums it
        pos = offs_t + tap - (W - 1)
        wt = tl.load(w_ptr + offs_d * W + tap, mask=md, other=0.0).to(tl.float32)
        val = tl.load(x_ptr + (b * T + pos[:, None]) * D + offs_d[None, :], mask=m2 & (pos[:, None] >= 0),
                      other=0.0).to(tl.float32)
        if HAS_STATE:
            val += tl.load(s_ptr + (b * (W - 1) + pos[:, None] + (W - 1)) * D + offs_d[None, :],
                           mask=m2 & (pos[:, None] < 0), other=0.0).to(tl.float32)
        if tap == 0:
            acc = val * wt[None, :]
        else:
            acc = acc + val * wt[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_d, mask=md, other=0.0).to(tl.float32)[None, :]
    dz = tl.load(do_ptr + (b * T + offs_t[:, None]) * D + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
    if SILU:
        sig = tl.sigmoid(acc)
        dz = dz * sig * (1.0 + acc * (1.0 - sig))
    dz = tl.where(m2, dz, 0.0)
    tl.store(dz_ptr + (b * T + offs_t[:, None]) * D + offs_d[None, :], dz, mask=m2)
    part = b * NT + tb
    for tap in tl.static_range(W):  # this block's share of d weight[:, tap]
        pos = offs_t + tap - (W - 1)
        val = tl.load(x_ptr + (b * T + pos[:, None]) * D + offs_d[None, :], mask=m2 & (pos[:, None] >= 0),
                      other=0.0).to(tl.float32)
        if HAS_STATE:
            val += tl.load(s_ptr + (b * (W - 1) + pos[:, None] + (W - 1)) * D + offs_d[None, :],
                           mask=m2 & (pos[:, None] < 0), other=0.0).to(tl.float32)
        tl.store(dw_part_ptr + (part * D + offs_d) * W + tap, tl.sum(dz * val, axis=0), mask=md)
    if HAS_BIAS:
        tl.store(db_part_ptr + part * D + offs_d, tl.sum(dz, axis=0), mask=md)


@triton.jit
def _conv_bwd_dx_kernel(dz_ptr, w_ptr, dx_ptr, ds_ptr, T, D, HAS_STATE: tl.constexpr, W: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs_j = tl.program_id(1) * BT + tl.arange(0, BT)  # positions of [state (W - 1), x (T)]
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    md = offs_d < D
    mj = offs_j < T + (W - 1)
    acc = tl.zeros([BT, BD], tl.float32)
    for tap in tl.static_range(W):  # output t = j - tap reads position j through tap
        t = offs_j - tap
        wt = tl.load(w_ptr + offs_d * W + tap, mask=md, other=0.0).to(tl.float32)
        m = (mj & (t >= 0) & (t < T))[:, None] & md[None, :]
        acc += tl.load(dz_ptr + (b * T + t[:, None]) * D + offs_d[None, :], mask=m, other=0.0) * wt[None, :]
    xpos = offs_j - (W - 1)
    mx = (mj & (xpos >= 0))[:, None] & md[None, :]
    tl.store(dx_ptr + (b * T + xpos[:, None]) * D + offs_d[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mx)
    if HAS_STATE:
        ms = (offs_j < W - 1)[:, None] & md[None, :]
        tl.store(ds_ptr + (b * (W - 1) + offs_j[:, None]) * D + offs_d[None, :], acc.to(ds_ptr.dtype.element_ty),
                 mask=ms)


def conv_backward(x, weight, bias, conv_state, d_out, *, silu: bool, config: LaunchConfig):
    """Gradients (dx, d weight, d bias or None, d conv_state or None) of ``out`` alone (the new state is x's and
    the state's last rows: autograd adds its gradient outside), each in its input's dtype. Inputs contiguous;
    ``conv_state`` None or [B, W - 1, D] with W > 1."""
    B, T, D = x.shape
    W = weight.shape[-1]
    BT, BD = config.block("tokens"), config.block("channels")
    NT = triton.cdiv(T, BT)
    f32 = dict(dtype=torch.float32, device=x.device)
    dz = torch.empty((B, T, D), **f32)
    dw_part = torch.empty((B * NT, D, W), **f32)
    db_part = torch.empty((B * NT, D), **f32) if bias is not None else None
    dx = torch.empty_like(x)
    d_state = torch.empty_like(conv_state) if conv_state is not None else None
    if T > 0:
        _conv_bwd_dz_kernel[(B, NT, triton.cdiv(D, BD))](
            x, weight, bias if bias is not None else x, conv_state if conv_state is not None else x,
            d_out.contiguous(), dz, dw_part, db_part if db_part is not None else dz, T, D, NT,
            HAS_BIAS=bias is not None, HAS_STATE=conv_state is not None, SILU=silu, W=W, BT=BT, BD=BD,
            **config.launch_kwargs())
        _conv_bwd_dx_kernel[(B, triton.cdiv(T + W - 1, BT), triton.cdiv(D, BD))](
            dz, weight, dx, d_state if d_state is not None else dz, T, D, HAS_STATE=d_state is not None, W=W, BT=BT,
            BD=BD, **config.launch_kwargs())
    elif d_state is not None:
        d_state.zero_()
    # the (batch row, token block) partials summed in order: torch's reduction, no atomics
    d_weight = dw_part.sum(dim=0).to(weight.dtype) if T > 0 else torch.zeros_like(weight)
    d_bias = None
    if bias is not None:
        d_bias = db_part.sum(dim=0).to(bias.dtype) if T > 0 else torch.zeros_like(bias)
    return dx, d_weight, d_bias, d_state
