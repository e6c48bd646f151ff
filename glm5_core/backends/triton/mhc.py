"""mHC (hyper-connections) in Triton: the Sinkhorn normalisation and the stream mix, forward and backward.

Legend: R rows (tokens), N streams (NP = N padded to a power of two), D hidden size, BR rows / BD hidden columns
per program, STEPS = 2 * iters - 1 normalisations.

``mhc_sinkhorn`` (one program per BR rows, the [BR, NP, NP] matrices in registers):
  forward   C = softmax_row(logits) + eps, then the column / row normalisations (``glm5_core.ops.mhc``);
  backward  the iterates are recomputed and kept in a scratch buffer [STEPS, R, NP, NP] (fp32), then walked
            back: for y = x / (sum_axis x + eps), dx = (dy - sum_axis(dy * y)) / (sum_axis x + eps); the softmax's
            dl = p * (dp - sum_row(dp * p)). The forward keeps only the logits (autograd's reference keeps every
            iterate for the whole step).
``mhc_mix`` (one program per row, looping over D in BD columns):
  forward   out[j, :] = post[j] * block[:] + sum_i comb[i, j] * res[i, :];
  backward  d res[i] = sum_j comb[i, j] g[j];  d block = sum_j post[j] g[j];  d post[j] = <g[j], block>;
            d comb[i, j] = <res[i], g[j]>  (the last two summed over the D blocks in order: no atomics).
Everything computes in fp32 (16-bit inputs widened on load), as the reference; fp64 runs the reference.
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
def _tile(ptr, row0, R, N, NP: tl.constexpr, BR: tl.constexpr):
    """Offsets and mask of rows row0 .. row0 + BR - 1 of an [R, N, N] tensor as [BR, NP, NP]."""
    r = row0 + tl.arange(0, BR)
    i = tl.arange(0, NP)
    offs = r[:, None, None].to(tl.int64) * N * N + i[None, :, None] * N + i[None, None, :]
    mask = (r[:, None, None] < R) & (i[None, :, None] < N) & (i[None, None, :] < N)
    return offs, mask


@triton.jit
def _softmax_rows(logits_ptr, offs, mask):
    x = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    top = tl.max(tl.where(mask, x, float("-inf")), axis=2)
    e = tl.where(mask, tl.exp(x - top[:, :, None]), 0.0)
    total = tl.sum(e, axis=2)
    return tl.where(mask, e / tl.where(total > 0, total, 1.0)[:, :, None], 0.0)


@triton.jit
def _normalise(c, mask, eps, ROWS: tl.constexpr):
    """c / (sum + eps) over each row (ROWS) or each column; padded entries stay 0."""
    if ROWS:
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
    else:
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    return tl.where(mask, c, 0.0)


@triton.jit
def _sinkhorn_fwd_kernel(logits_ptr, out_ptr, R, N, iters, eps, NP: tl.constexpr, BR: tl.constexpr):
    offs, mask = _tile(logits_ptr, tl.program_id(0) * BR, R, N, NP, BR)
    c = tl.where(mask, _softmax_rows(logits_ptr, offs, mask) + eps, 0.0)
    c = _normalise(c, mask, eps, False)
    for _ in range(iters - 1):
        c = _normalise(c, mask, eps, True)
        c = _normalise(c, mask, eps, False)
    tl.store(out_ptr + offs, c, mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(logits_ptr, grad_ptr, dlogits_ptr, scratch_ptr, R, N, steps, eps,
                         NP: tl.constexpr, BR: tl.constexpr):
    row0 = tl.program_id(0) * BR
    offs, mask = _tile(logits_ptr, row0, R, N, NP, BR)
    # scratch [STEPS, R, NP, NP]: the input of every normalisation step (step k reads iterate k)
    r = row0 + tl.arange(0, BR)
    i = tl.arange(0, NP)
    s_offs = r[:, None, None].to(tl.int64) * NP * NP + i[None, :, None] * NP + i[None, None, :]
    s_mask = r[:, None, None] < R
    plane = R.to(tl.int64) * NP * NP
    p = _softmax_rows(logits_ptr, offs, mask)
    c = tl.where(mask, p + eps, 0.0)
    for k in range(0, steps):  # step k: columns when k is even, rows when odd
        tl.store(scratch_ptr + k * plane + s_offs, c, mask=s_mask)
        if k % 2 == 0:
            c = _normalise(c, mask, eps, False)
        else:
            c = _normalise(c, mask, eps, True)
    tl.debug_barrier()
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = c
    for kk in range(0, steps):
        k = steps - 1 - kk
        x = tl.load(scratch_ptr + k * plane + s_offs, mask=s_mask, other=0.0)
        if k % 2 == 0:
            g = (g - tl.sum(g * y, axis=1)[:, None, :]) / (tl.sum(x, axis=1)[:, None, :] + eps)
        else:
            g = (g - tl.sum(g * y, axis=2)[:, :, None]) / (tl.sum(x, axis=2)[:, :, None] + eps)
        g = tl.where(mask, g, 0.0)
        y = x
    dl = p * (g - tl.sum(g * p, axis=2)[:, :, None])  # softmax backward (the + eps adds nothing)
    tl.store(dlogits_ptr + offs, dl, mask=mask)


@triton.jit
def _mix_fwd_kernel(res_ptr, block_ptr, post_ptr, comb_ptr, out_ptr, N, D, NP: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    comb = tl.load(comb_ptr + row * N * N + i[:, None] * N + i[None, :], mask=(i[:, None] < N) & (i[None, :] < N),
                   other=0.0).to(tl.float32)  # [NP (i), NP (j)]
    post = tl.load(post_ptr + row * N + i, mask=i < N, other=0.0).to(tl.float32)  # [NP]
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m2 = (i[:, None] < N) & (d[None, :] < D)
        res = tl.load(res_ptr + row * N * D + i[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        blk = tl.load(block_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        mixed = tl.sum(comb[:, :, None] * res[:, None, :], axis=0)  # [NP (j), BD]
        out = post[:, None] * blk[None, :] + mixed
        tl.store(out_ptr + row * N * D + i[:, None] * D + d[None, :], out, mask=m2)


@triton.jit
def _mix_bwd_kernel(res_ptr, block_ptr, post_ptr, comb_ptr, g_ptr, dres_ptr, dblock_ptr, dpost_ptr, dcomb_ptr,
                    N, D, NP: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    cmask = (i[:, None] < N) & (i[None, :] < N)
    comb = tl.load(comb_ptr + row * N * N + i[:, None] * N + i[None, :], mask=cmask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + row * N + i, mask=i < N, other=0.0).to(tl.float32)
    d_post = tl.zeros([NP], tl.float32)
    d_comb = tl.zeros([NP, NP], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m2 = (i[:, None] < N) & (d[None, :] < D)
        res = tl.load(res_ptr + row * N * D + i[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * N * D + i[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        blk = tl.load(block_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        d_res = tl.sum(comb[:, :, None] * g[None, :, :], axis=1)  # [NP (i), BD]
        tl.store(dres_ptr + row * N * D + i[:, None] * D + d[None, :], d_res, mask=m2)
        tl.store(dblock_ptr + row * D + d, tl.sum(post[:, None] * g, axis=0), mask=d < D)
        d_post += tl.sum(g * blk[None, :], axis=1)
        d_comb += tl.sum(res[:, None, :] * g[None, :, :], axis=2)  # [NP (i), NP (j)]
    tl.store(dpost_ptr + row * N + i, d_post, mask=i < N)
    tl.store(dcomb_ptr + row * N * N + i[:, None] * N + i[None, :], d_comb, mask=cmask)


def _np(n: int) -> int:
    return _util.next_pow2(n, 2)


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps, config):
        x = logits.contiguous()
        R, N = x.shape[0], x.shape[1]
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        BR = config.block("rows")
        if R:
            _sinkhorn_fwd_kernel[(triton.cdiv(R, BR),)](x, out, R, N, iters, float(eps), NP=_np(N), BR=BR,
                                                         **config.launch_kwargs())
        ctx.save_for_backward(x)
        ctx.iters, ctx.eps, ctx.config, ctx.dtype = iters, eps, config, logits.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        R, N = x.shape[0], x.shape[1]
        NP, BR, steps = _np(N), ctx.config.block("rows"), 2 * ctx.iters - 1
        d_logits = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        if R:
            scratch = torch.empty((steps, R, NP, NP), dtype=torch.float32, device=x.device)
            _sinkhorn_bwd_kernel[(triton.cdiv(R, BR),)](x, grad.contiguous(), d_logits, scratch, R, N, steps,
                                                         float(ctx.eps), NP=NP, BR=BR, **ctx.config.launch_kwargs())
        return d_logits.to(ctx.dtype), None, None, None


def sinkhorn(logits, *, iters: int, eps: float, config: LaunchConfig):
    """``mhc_sinkhorn``: fp32 [R, N, N]; differentiable in the logits."""
    return _Sinkhorn.apply(logits, iters, eps, config)


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, block_out, post, comb, config):
        res, blk, pst, cmb = (t.contiguous() for t in (residual, block_out, post, comb))
        R, N, D = res.shape
        out = torch.empty((R, N, D), dtype=torch.float32, device=res.device)
        if R:
            _mix_fwd_kernel[(R,)](res, blk, pst, cmb, out, N, D, NP=_np(N), BD=config.block("cols"),
                                  **config.launch_kwargs())
        ctx.save_for_backward(res, blk, pst, cmb)
        ctx.config = config
        return out.to(residual.dtype)

    @staticmethod
    def backward(ctx, grad):
        res, blk, pst, cmb = ctx.saved_tensors
        R, N, D = res.shape
        f32 = dict(dtype=torch.float32, device=res.device)
        d_res, d_blk = torch.empty((R, N, D), **f32), torch.empty((R, D), **f32)
        d_post, d_comb = torch.empty((R, N), **f32), torch.empty((R, N, N), **f32)
        if R:
            _mix_bwd_kernel[(R,)](res, blk, pst, cmb, grad.contiguous(), d_res, d_blk, d_post, d_comb, N, D,
                                  NP=_np(N), BD=ctx.config.block("cols"), **ctx.config.launch_kwargs())
        return d_res.to(res.dtype), d_blk.to(blk.dtype), d_post.to(pst.dtype), d_comb.to(cmb.dtype), None


def mix(residual, block_out, post, comb, *, config: LaunchConfig):
    """``mhc_mix``: [R, N, D] in residual's dtype; differentiable in all four inputs."""
    return _Mix.apply(residual, block_out, post, comb, config)


_MAX_STREAMS = 16  # [BR, NP, NP] register tiles; GLM-5.3 has 4 streams


def _supports(name: str, t: torch.Tensor, streams: int):
    why = _util.float_dtype_verdict(name, t)
    if why:
        return False, why
    if streams > _MAX_STREAMS:
        return False, f"{streams} streams: the Triton mHC kernels hold [N, N] tiles of at most {_MAX_STREAMS}"
    return True, ""


def sinkhorn_supports(logits, **kwargs):
    return _supports("logits", logits, logits.shape[-1])


def mix_supports(residual, block_out, post, comb, **kwargs):
    for name, t in (("residual", residual), ("block_out", block_out), ("post", post), ("comb", comb)):
        ok, why = _supports(name, t, residual.shape[1])
        if not ok:
            return ok, why
    return True, ""


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "mhc"
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 16, "cols": 128})
ITEMSIZES = (4, 2)


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    """No tl.dot: every operand lives in registers (the [BR, 4, 4] / [N, BD] tiles of GLM-5.3's 4 streams); the
    reductions' scratch is the compiler's."""
    return {"sinkhorn_fwd": [], "sinkhorn_bwd": [], "mix_fwd": [], "mix_bwd": []}


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    launch = configs.get(FAMILY, DEFAULT_LAUNCH)
    return {"mhc_sinkhorn": bind(sinkhorn, launch, sinkhorn_supports, differentiable=True),
            "mhc_mix": bind(mix, launch, mix_supports, differentiable=True)}
