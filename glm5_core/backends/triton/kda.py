"""KDA in Triton: the fused recurrence (``kda_recurrent``, and the forward of ``kda_chunked``) and the short causal
conv (``kda_causal_conv`` and its decode step ``kda_causal_conv_update``).

Legend as in ``glm5_core.ops.kda``: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V];
x [B, T, D], weight [D, W], conv state [B, W - 1, D]. BK = next power of two >= K, BV / BT / BD tiles.

``_recurrent_kernel``: one program per (batch row, head, BV value columns). The state's columns evolve
independently (S^T k is per column), so a program keeps its [BK, BV] slice of the state in registers, fp32, for
the whole sequence: per token it decays the rows by exp(g), reads S^T k, writes k u^T, reads S^T q. No dot
products (per-token matrix-vector work), no shared memory beyond the two column reductions.

``kda_chunked`` runs this same fused recurrence forward: the chunked form is the same function (the module
docstring of ``glm5_core.ops.kda``), ``chunk_size`` only moves its rounding. Both are differentiable (in q, k, v,
g, beta and the initial state): ``_Recurrence`` pairs the forward with the reverse-time kernel of ``kda_bwd``
(state checkpoints recomputed in the backward, its docstring gives the memory / time trade-off). A tensor-core
chunked kernel (FLA's WY form) is not built here.

``_conv_kernel``: one program per (batch row, BT tokens, BD channels); W taps (a constexpr), each read from x or,
before the sequence, from the conv state; fp32 sums in tap order (the reference's order), then SiLU. ``_Conv``
pairs it with ``kda_bwd``'s conv backward (x, weight, bias, conv state).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util, kda_bwd
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.kernel import Kernel
from glm5_core.ops import kda as ops

MAX_HEAD_DIM = 256  # K: the [BK, BV] state slice stays in registers
MAX_CONV_WIDTH = 16


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, o_ptr, sT_ptr, T, H, K, V, scale, eps,
                      HAS_S0: tl.constexpr, STORE_S: tl.constexpr, L2NORM: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    m2 = mk[:, None] & mv[None, :]
    s_off = bh * K * V + offs_k[:, None] * V + offs_v[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], tl.float32)
    for t in range(T):
        row = (b * T + t) * H + h  # token t of (b, h) in [B, T, H, .]
        q = tl.load(q_ptr + row * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        k, a, v, beta = kda_bwd._token(k_ptr, g_ptr, v_ptr, beta_ptr, row, K, V, offs_k, offs_v, mk, mv, eps,
                                       L2NORM)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
        q = q * scale
        _, _, _, S = kda_bwd._step(S, k, v, a, beta)  # decay, delta rule: the backward's own step
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + row * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)
    if STORE_S:
        tl.store(sT_ptr + s_off, S, mask=m2)


def _recurrent_forward(q, k, v, g, beta, initial_state, scale: float, output_final_state: bool,
                       use_qk_l2norm: bool, config: LaunchConfig):
    """The fused recurrence on contiguous inputs: (o [B, T, H, V] in q's dtype, final state fp32 or None)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    o = torch.empty_like(v, dtype=q.dtype)
    s0 = initial_state
    sT = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    BV = min(config.block("v"), _util.next_pow2(V))
    if T == 0 and output_final_state:  # nothing to run: the state passes through
        sT.copy_(s0 if s0 is not None else torch.zeros_like(sT))
    elif T > 0 or output_final_state:
        _recurrent_kernel[(B * H, triton.cdiv(V, BV))](
            q, k, v, g, beta, s0 if s0 is not None else q, o, sT if sT is not None else q, T, H, K, V, scale,
            ops.L2NORM_EPS, HAS_S0=s0 is not None, STORE_S=sT is not None, L2NORM=use_qk_l2norm,
            BK=_util.next_pow2(K), BV=BV, **config.launch_kwargs())
    return o, sT


class _Recurrence(torch.autograd.Function):
    """The fused recurrence forward; backward by ``kda_bwd.recurrent_backward`` (the reverse-time kernel, which
    recomputes the states from the inputs: nothing but the inputs is saved)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, use_qk_l2norm, config):
        inputs = [t.contiguous() for t in (q, k, v, g, beta)]
        s0 = initial_state.contiguous() if initial_state is not None else None
        o, sT = _recurrent_forward(*inputs, s0, scale, output_final_state, use_qk_l2norm, config)
        ctx.save_for_backward(*inputs, s0)
        ctx.scale, ctx.use_qk_l2norm, ctx.config = scale, use_qk_l2norm, config
        return o, sT

    @staticmethod
    def backward(ctx, d_o, d_state):
        q, k, v, g, beta, s0 = ctx.saved_tensors
        grads = kda_bwd.recurrent_backward(q, k, v, g, beta, s0, d_o, d_state, scale=ctx.scale,
                                           use_qk_l2norm=ctx.use_qk_l2norm, config=ctx.config)
        return (*grads, None, None, None, None)


def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state: bool = False,
              use_qk_l2norm: bool = False, config: LaunchConfig):
    """The recurrence fused, state fp32. Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32 or
    None); differentiable in q, k, v, g, beta and the initial state (the reverse-time kernel of ``kda_bwd``)."""
    K = k.shape[-1]
    scale = float(K ** -0.5 if scale is None else scale)
    if not torch.is_grad_enabled():  # no autograd node to build (decode)
        inputs = [t.contiguous() for t in (q, k, v, g, beta)]
        s0 = initial_state.contiguous() if initial_state is not None else None
        return _recurrent_forward(*inputs, s0, scale, output_final_state, use_qk_l2norm, config)
    return _Recurrence.apply(q, k, v, g, beta, initial_state, scale, output_final_state, use_qk_l2norm, config)


def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state: bool = False,
            chunk_size: int = ops.DEFAULT_CHUNK_SIZE, use_qk_l2norm: bool = False, config: LaunchConfig):
    """``kda_chunked`` forward by the fused recurrence (module docstring); ``chunk_size`` does not change it."""
    return recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, config=config)


def kda_supports(q, k, v, g, beta, *, initial_state=None, **kwargs):
    for name, t in (("q", q), ("g", g), ("beta", beta)):
        why = _util.float_dtype_verdict(name, t)
        if why:
            return False, why
    if initial_state is not None and initial_state.dtype != torch.float32:
        return False, f"initial_state is {initial_state.dtype}; the kernel keeps an fp32 state"
    if k.shape[-1] > MAX_HEAD_DIM:
        return False, f"K={k.shape[-1]} > {MAX_HEAD_DIM}: the state slice would not fit in registers"
    return True, ""


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, s_ptr, o_ptr, T, D, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                 SILU: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_d = tl.program_id(2) * BD + tl.arange(0, BD)
    mt = offs_t < T
    md = offs_d < D
    acc = tl.zeros([BT, BD], tl.float32)
    for tap in tl.static_range(W):
        pos = offs_t + tap - (W - 1)  # the input position this tap reads; < 0: the conv state
        wt = tl.load(w_ptr + offs_d * W + tap, mask=md, other=0.0).to(tl.float32)
        inside = mt[:, None] & md[None, :] & (pos[:, None] >= 0)
        val = tl.load(x_ptr + (b * T + pos[:, None]) * D + offs_d[None, :], mask=inside, other=0.0).to(tl.float32)
        if HAS_STATE:
            before = mt[:, None] & md[None, :] & (pos[:, None] < 0)
            spos = pos + (W - 1)
            val += tl.load(s_ptr + (b * (W - 1) + spos[:, None]) * D + offs_d[None, :], mask=before,
                           other=0.0).to(tl.float32)
        if tap == 0:
            acc = val * wt[None, :]
        else:
            acc = acc + val * wt[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_d, mask=md, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(o_ptr + (b * T + offs_t[:, None]) * D + offs_d[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


def _conv_forward(x, weight, bias, state, silu: bool, config: LaunchConfig):
    B, T, D = x.shape
    out = torch.empty_like(x)
    BT, BD = config.block("tokens"), config.block("channels")
    if T > 0:
        _conv_kernel[(B, triton.cdiv(T, BT), triton.cdiv(D, BD))](
            x, weight, bias if bias is not None else x, state if state is not None else x, out, T, D,
            HAS_BIAS=bias is not None, HAS_STATE=state is not None, SILU=silu, W=weight.shape[-1], BT=BT, BD=BD,
            **config.launch_kwargs())
    return out


class _Conv(torch.autograd.Function):
    """The conv's output; backward by ``kda_bwd.conv_backward`` (x, weight, bias, conv state)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, silu, config):
        x, weight = x.contiguous(), weight.contiguous()
        bias = bias.contiguous() if bias is not None else None
        state = state.contiguous() if state is not None else None
        ctx.save_for_backward(x, weight, bias, state)
        ctx.silu, ctx.config = silu, config
        return _conv_forward(x, weight, bias, state, silu, config)

    @staticmethod
    def backward(ctx, d_out):
        x, weight, bias, state = ctx.saved_tensors
        grads = kda_bwd.conv_backward(x, weight, bias, state, d_out, silu=ctx.silu, config=ctx.config)
        return (*grads, None, None)


def causal_conv(x, weight, bias=None, *, conv_state=None, activation="silu", output_final_state: bool = False,
                config: LaunchConfig):
    """The conv over x [B, T, D]. Returns (out [B, T, D] in x's dtype, new state [B, W - 1, D] fp32 or None);
    differentiable in x, weight, bias and the conv state."""
    B, T, D = x.shape
    W = weight.shape[-1]
    state = conv_state if conv_state is not None and W > 1 else None
    silu = activation == "silu"
    if torch.is_grad_enabled():
        out = _Conv.apply(x, weight, bias, state, silu, config)
    else:
        out = _conv_forward(x.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None,
                            state.contiguous() if state is not None else None, silu, config)
    new_state = None
    if output_final_state:  # the last W - 1 inputs: a copy, no arithmetic (autograd carries its gradient)
        before = conv_state if conv_state is not None else x.new_zeros(B, W - 1, D, dtype=torch.float32)
        full = torch.cat([before.to(torch.float32), x.to(torch.float32)], dim=1)
        new_state = full[:, full.shape[1] - (W - 1):].contiguous()
    return out, new_state


def causal_conv_update(x, conv_state, weight, bias=None, *, activation="silu", config: LaunchConfig):
    """One step: x [B, D]. Returns (out [B, D], new state [B, W - 1, D] fp32)."""
    out, state = causal_conv(x.unsqueeze(1), weight, bias, conv_state=conv_state, activation=activation,
                             output_final_state=True, config=config)
    return out.squeeze(1), state


def _conv_verdict(x, weight, conv_state):
    for name, t in (("x", x), ("weight", weight)):
        why = _util.float_dtype_verdict(name, t)
        if why:
            return False, why
    if conv_state is not None and conv_state.dtype != torch.float32:
        return False, f"conv_state is {conv_state.dtype}; the kernel keeps an fp32 state"
    if weight.shape[-1] > MAX_CONV_WIDTH:
        return False, f"W={weight.shape[-1]} > {MAX_CONV_WIDTH} taps (unrolled)"
    return True, ""


def conv_supports(x, weight, bias=None, *, conv_state=None, **kwargs):
    return _conv_verdict(x, weight, conv_state)


def conv_update_supports(x, conv_state, weight, bias=None, **kwargs):
    return _conv_verdict(x, weight, conv_state)


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "kda"  # this module's launch configuration
# v / v_bwd: value columns per program of the recurrence / its backward (the backward holds four [BK, BV] fp32
# tiles: at K = 128 and 4 warps, BV = 16 compiles for sm_90 in 251 registers without spills, BV = 32 spills);
# checkpoint: tokens per backward checkpoint (memory only, not numerics); rows: token rows per program of the
# backward's reduction over the value blocks (8 x 128 fp32: 119 registers, 16: 251); tokens / channels: the
# conv's tiles
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=1, blocks={"v": 32, "v_bwd": 16, "checkpoint": 32, "rows": 8,
                                                                 "tokens": 16, "channels": 64})
ITEMSIZES = (4,)  # everything in fp32 inside


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    # no tl.dot: only the two column reductions of the [BK, BV] state slice cross warps
    return {"recurrent": [Tile("state", (MAX_HEAD_DIM, blocks["v"]), 4, scratch=True)],
            "recurrent_bwd": [Tile("state", (MAX_HEAD_DIM, blocks["v_bwd"]), 4, scratch=True)],
            "recurrent_bwd_reduce": [Tile("rows", (blocks["rows"], MAX_HEAD_DIM), 4, scratch=True)],
            "conv": [], "conv_bwd_dz": [Tile("dz", (blocks["tokens"], blocks["channels"]), 4, scratch=True)],
            "conv_bwd_dx": []}


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    config = configs.get(FAMILY, DEFAULT_LAUNCH)
    # backward through _Recurrence / _Conv (kda_bwd)
    return {"kda_recurrent": bind(recurrent, config, kda_supports, differentiable=True),
            "kda_chunked": bind(chunked, config, kda_supports, differentiable=True),
            "kda_causal_conv": bind(causal_conv, config, conv_supports, differentiable=True),
            "kda_causal_conv_update": bind(causal_conv_update, config, conv_update_supports)}
