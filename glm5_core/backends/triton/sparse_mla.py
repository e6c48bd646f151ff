"""Sparse MLA attention over the selected latent rows (DSA), forward and backward, as Triton kernels.

Legend: B batch, T queries, S key slots, H attention heads, C latent width (kv_lora_rank),
        Dr rope dim, K selected keys per query, R = B * T query rows, BH / BK head / key tiles.

The public ops take the full-level arguments; the kernels work on the absorbed (latent) level:
  q_lat = absorb_query(q_nope, w_uk)      [B, T, H, C]     (torch, fp32)
  o_lat = softmax(scale * (q_lat . c_kv[idx] + q_pe . k_pe[idx])) @ c_kv[idx]   (kernel)
  out   = project_output(o_lat, w_uv)     [B, T, H, Dv]    (torch)
so autograd covers the two projections and ``_SparseLatentAttention`` covers the kernel.

Forward: one program per (query row, head tile); it walks the query's K selected indices in tiles
of BK, gathers those latent rows, and keeps an online softmax (running max, running sum, fp32
accumulator). Entries equal to -1 are skipped; a query with no selected key yields zeros.

Backward (recomputes probabilities from the saved log-sum-exp):
  dq kernel   -- one program per (query row, head tile): dq_lat, dq_pe (a sum over the K keys);
  dkv kernel  -- one program per (query row, key tile): the gradient each selected slot sends to its
                 latent row, summed over heads in head order, written per slot;
then the per-slot gradients are summed into dc_kv / dk_pe by a sorted (deterministic) index_put.

Precision. fp32 / fp16 inputs: every product is exact fp32 (16-bit tiles are widened), so the result tracks
the fp32 reference. bf16 inputs (``uses_tensor_cores``): the prefill forward and backward run their products
on bf16 tensor cores with fp32 accumulators, the FlashAttention recipe: q_lat, q_pe, the gathered keys and
d_out are bf16, the probabilities p and score gradients ds are rounded to bf16 for p @ kv, ds @ kv, p^T dO,
ds^T q; softmax statistics, delta and all accumulations stay fp32, and gradients leave the kernels in fp32.
Under the interpreter (CPU tensors) bf16 ``tl.dot`` is unusable and its fp32 -> bf16 cast truncates, so the
kernels round the same operands to nearest-even bf16 themselves and multiply them in fp32, which is exact
for bf16 x bf16: the rounding points, hence the error the conformance checks measure, are the GPU's.
The decode path keeps exact fp32 products for every dtype.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util, shared_memory
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.kernel import Kernel
from glm5_core.ops.mla import absorb_query, project_output

_SLOT_BUDGET = 1 << 26  # fp32 elements of per-slot key gradients held at once by the backward (256 MiB)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32: the GPU's cast, bit for bit, also under the
    interpreter (whose own fp32 -> bf16 cast truncates). Finite inputs (probabilities, scores, gradients)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mm(a, b, TC: tl.constexpr, EMULATE: tl.constexpr):
    """a @ b of fp32 tiles, fp32 result. TC: a bf16 tensor-core product (operands rounded to bf16, fp32
    accumulation); EMULATE (the interpreter, whose bf16 dot is unusable): the same rounded operands, whose
    products are exact in fp32, multiplied in fp32. Otherwise exact fp32 products."""
    if TC:  # (one return: the compiler does not prune code after a return under a constexpr branch)
        if EMULATE:
            out = tl.dot(_round_to_bf16(a.to(tl.float32)), _round_to_bf16(b.to(tl.float32)), input_precision="ieee")
        else:
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _gather_keys(ckv_ptr, kpe_ptr, idx_ptr, b, row, k0, K, stride_cb, stride_cs, stride_kb, stride_ks, stride_ir,
                 C: tl.constexpr, DR: tl.constexpr, BK: tl.constexpr, C_PAD: tl.constexpr, DR_PAD: tl.constexpr):
    """Latent rows [BK, C] and rope keys [BK, DR] (fp32) of selected slots k0..k0+BK-1, and their mask."""
    offs_k = k0 + tl.arange(0, BK)
    ids = tl.load(idx_ptr + row * stride_ir + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
    valid = ids >= 0
    rows = tl.where(valid, ids, 0)
    offs_c = tl.arange(0, C_PAD)
    offs_r = tl.arange(0, DR_PAD)
    kv = tl.load(ckv_ptr + b * stride_cb + rows[:, None] * stride_cs + offs_c[None, :],
                 mask=valid[:, None] & (offs_c[None, :] < C), other=0.0).to(tl.float32)
    kr = tl.load(kpe_ptr + b * stride_kb + rows[:, None] * stride_ks + offs_r[None, :],
                 mask=valid[:, None] & (offs_r[None, :] < DR), other=0.0).to(tl.float32)
    return kv, kr, valid


@triton.jit
def _load_heads(ptr, row, h0, stride_r, stride_h, H, D: tl.constexpr, BH: tl.constexpr, D_PAD: tl.constexpr):
    """Rows h0..h0+BH-1 of a [R, H, D] tensor (contiguous last dim) -> [BH, D_PAD] (fp32; bf16 when TC)."""
    offs_h = h0 + tl.arange(0, BH)
    offs_d = tl.arange(0, D_PAD)
    return tl.load(ptr + row * stride_r + offs_h[:, None] * stride_h + offs_d[None, :],
                   mask=(offs_h[:, None] < H) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _row_and_heads(qlat_ptr, qpe_ptr, T, H, C: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr,
                   C_PAD: tl.constexpr, DR_PAD: tl.constexpr):
    """A (query row, head tile) program's row, batch row, first head and its q_lat [BH, C_PAD] / q_pe [BH, DR_PAD]."""
    row = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BH
    q_lat = _load_heads(qlat_ptr, row, h0, H * C, C, H, C, BH, C_PAD)
    q_pe = _load_heads(qpe_ptr, row, h0, H * DR, DR, H, DR, BH, DR_PAD)
    return row, row // T, h0, q_lat, q_pe


@triton.jit
def _sparse_fwd_kernel(qlat_ptr, qpe_ptr, ckv_ptr, kpe_ptr, idx_ptr, out_ptr, lse_ptr,
                       T, H, K, scale, stride_cb, stride_cs, stride_kb, stride_ks, stride_ir,
                       C: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                       C_PAD: tl.constexpr, DR_PAD: tl.constexpr, TC: tl.constexpr, EMULATE: tl.constexpr):
    row, b, h0, q_lat, q_pe = _row_and_heads(qlat_ptr, qpe_ptr, T, H, C, DR, BH, C_PAD, DR_PAD)
    m = tl.full([BH], float("-inf"), tl.float32)
    row_sum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, C_PAD], tl.float32)
    for k0 in range(0, K, BK):
        kv, kr, valid = _gather_keys(ckv_ptr, kpe_ptr, idx_ptr, b, row, k0, K, stride_cb, stride_cs,
                                     stride_kb, stride_ks, stride_ir, C, DR, BK, C_PAD, DR_PAD)
        s = _mm(q_lat, tl.trans(kv), TC, EMULATE) + _mm(q_pe, tl.trans(kr), TC, EMULATE)
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BH, BK]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp() finite
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _mm(p, kv, TC, EMULATE)
        m = m_new
    has_key = row_sum != 0.0  # 0: no key; a NaN sum (a NaN / +inf score) gives NaN, as the reference's softmax
    out = tl.where(has_key[:, None], acc / tl.where(has_key, row_sum, 1.0)[:, None], 0.0)
    lse = tl.where(has_key, m + tl.log(tl.where(has_key, row_sum, 1.0)), float("inf"))  # +inf: every p is 0
    offs_h = h0 + tl.arange(0, BH)
    offs_c = tl.arange(0, C_PAD)
    tl.store(out_ptr + row * H * C + offs_h[:, None] * C + offs_c[None, :], out,
             mask=(offs_h[:, None] < H) & (offs_c[None, :] < C))
    tl.store(lse_ptr + row * H + offs_h, lse, mask=offs_h < H)


@triton.jit
def _probs_and_dscores(q_lat, q_pe, d_out, lse, delta, kv, kr, valid, scale, TC: tl.constexpr,
                       EMULATE: tl.constexpr):
    """Recompute p = exp(s - lse) and ds = p * (dO . kv - delta) for one [heads, keys] tile."""
    s = _mm(q_lat, tl.trans(kv), TC, EMULATE) + _mm(q_pe, tl.trans(kr), TC, EMULATE)
    p = tl.where(valid[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
    dp = _mm(d_out, tl.trans(kv), TC, EMULATE)
    return p, p * (dp - delta[:, None])


@triton.jit
def _load_backward_heads(qlat_ptr, qpe_ptr, dout_ptr, lse_ptr, delta_ptr, row, h0, H, C: tl.constexpr,
                         DR: tl.constexpr, BH: tl.constexpr, C_PAD: tl.constexpr, DR_PAD: tl.constexpr):
    """What the backward reads of heads h0..h0+BH-1 of one query row: q_lat, q_pe, d_out tiles and the
    log-sum-exp / delta rows (+inf / 0 past H)."""
    offs_h = h0 + tl.arange(0, BH)
    q_lat = _load_heads(qlat_ptr, row, h0, H * C, C, H, C, BH, C_PAD)  # [BH, C_PAD]
    q_pe = _load_heads(qpe_ptr, row, h0, H * DR, DR, H, DR, BH, DR_PAD)  # [BH, DR_PAD]
    d_out = _load_heads(dout_ptr, row, h0, H * C, C, H, C, BH, C_PAD)  # [BH, C_PAD]
    lse = tl.load(lse_ptr + row * H + offs_h, mask=offs_h < H, other=float("inf"))
    delta = tl.load(delta_ptr + row * H + offs_h, mask=offs_h < H, other=0.0)
    return q_lat, q_pe, d_out, lse, delta


@triton.jit
def _sparse_bwd_dq_kernel(qlat_ptr, qpe_ptr, ckv_ptr, kpe_ptr, idx_ptr, dout_ptr, lse_ptr, delta_ptr,
                          dqlat_ptr, dqpe_ptr, T, H, K, scale, stride_cb, stride_cs, stride_kb, stride_ks,
                          stride_ir, C: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                          C_PAD: tl.constexpr, DR_PAD: tl.constexpr, TC: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BH
    b = row // T
    offs_h = h0 + tl.arange(0, BH)
    q_lat, q_pe, d_out, lse, delta = _load_backward_heads(qlat_ptr, qpe_ptr, dout_ptr, lse_ptr, delta_ptr, row, h0,
                                                          H, C, DR, BH, C_PAD, DR_PAD)
    dq_lat = tl.zeros([BH, C_PAD], tl.float32)
    dq_pe = tl.zeros([BH, DR_PAD], tl.float32)
    for k0 in range(0, K, BK):
        kv, kr, valid = _gather_keys(ckv_ptr, kpe_ptr, idx_ptr, b, row, k0, K, stride_cb, stride_cs,
                                     stride_kb, stride_ks, stride_ir, C, DR, BK, C_PAD, DR_PAD)
        p, ds = _probs_and_dscores(q_lat, q_pe, d_out, lse, delta, kv, kr, valid, scale, TC, EMULATE)
        dq_lat += _mm(ds, kv, TC, EMULATE)
        dq_pe += _mm(ds, kr, TC, EMULATE)
    offs_c = tl.arange(0, C_PAD)
    offs_r = tl.arange(0, DR_PAD)
    tl.store(dqlat_ptr + row * H * C + offs_h[:, None] * C + offs_c[None, :], dq_lat * scale,
             mask=(offs_h[:, None] < H) & (offs_c[None, :] < C))
    tl.store(dqpe_ptr + row * H * DR + offs_h[:, None] * DR + offs_r[None, :], dq_pe * scale,
             mask=(offs_h[:, None] < H) & (offs_r[None, :] < DR))


@triton.jit
def _sparse_bwd_dkv_kernel(qlat_ptr, qpe_ptr, ckv_ptr, kpe_ptr, idx_ptr, dout_ptr, lse_ptr, delta_ptr,
                           dkv_slots_ptr, dkr_slots_ptr, row0, T, H, K, scale, stride_cb, stride_cs,
                           stride_kb, stride_ks, stride_ir,
                           C: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                           C_PAD: tl.constexpr, DR_PAD: tl.constexpr, TC: tl.constexpr, EMULATE: tl.constexpr):
    local = tl.program_id(0).to(tl.int64)  # row within this chunk
    row = row0 + local
    k0 = tl.program_id(1) * BK
    b = row // T
    kv, kr, valid = _gather_keys(ckv_ptr, kpe_ptr, idx_ptr, b, row, k0, K, stride_cb, stride_cs,
                                 stride_kb, stride_ks, stride_ir, C, DR, BK, C_PAD, DR_PAD)
    dkv = tl.zeros([BK, C_PAD], tl.float32)
    dkr = tl.zeros([BK, DR_PAD], tl.float32)
    for h0 in range(0, H, BH):  # fixed head order
        q_lat, q_pe, d_out, lse, delta = _load_backward_heads(qlat_ptr, qpe_ptr, dout_ptr, lse_ptr, delta_ptr, row,
                                                              h0, H, C, DR, BH, C_PAD, DR_PAD)
        p, ds = _probs_and_dscores(q_lat, q_pe, d_out, lse, delta, kv, kr, valid, scale, TC, EMULATE)
        dkv += _mm(tl.trans(p), d_out, TC, EMULATE)
        dkv += _mm(tl.trans(ds), q_lat, TC, EMULATE) * scale
        dkr += _mm(tl.trans(ds), q_pe, TC, EMULATE) * scale
    offs_k = k0 + tl.arange(0, BK)
    offs_c = tl.arange(0, C_PAD)
    offs_r = tl.arange(0, DR_PAD)
    kmask = offs_k[:, None] < K
    tl.store(dkv_slots_ptr + local * K * C + offs_k[:, None] * C + offs_c[None, :], dkv,
             mask=kmask & (offs_c[None, :] < C))
    tl.store(dkr_slots_ptr + local * K * DR + offs_k[:, None] * DR + offs_r[None, :], dkr,
             mask=kmask & (offs_r[None, :] < DR))


def _meta(q_lat, q_pe, config: LaunchConfig, tensor_cores: bool = False):
    C, DR = q_lat.shape[-1], q_pe.shape[-1]
    return dict(C=C, DR=DR, BH=config.block("heads"), BK=config.block("keys"),
                C_PAD=_util.next_pow2(C, 16), DR_PAD=_util.next_pow2(DR, 16),
                TC=tensor_cores, EMULATE=tensor_cores and q_lat.device.type == "cpu")  # cpu: the interpreter


def _key_strides(c_kv, k_pe, idx):
    assert c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1 and idx.is_contiguous()
    return (c_kv.stride(0), c_kv.stride(1), k_pe.stride(0), k_pe.stride(1), idx.shape[-1])


def latent_forward(q_lat, q_pe, c_kv, k_pe, idx, scale: float, config: LaunchConfig, tensor_cores: bool = False):
    """o_lat fp32 [B, T, H, C] and log-sum-exp fp32 [B, T, H] (+inf for a query with no key).
    ``tensor_cores``: every operand is bf16 and the products run on bf16 tensor cores (fp32 accumulation)."""
    B, T, H, C = q_lat.shape
    K = idx.shape[-1]
    out = torch.empty((B, T, H, C), dtype=torch.float32, device=q_lat.device)
    lse = torch.empty((B, T, H), dtype=torch.float32, device=q_lat.device)
    meta = _meta(q_lat, q_pe, config, tensor_cores)
    _sparse_fwd_kernel[(B * T, triton.cdiv(H, meta["BH"]))](
        q_lat, q_pe, c_kv, k_pe, idx, out, lse, T, H, K, scale, *_key_strides(c_kv, k_pe, idx),
        **meta, **config.launch_kwargs())
    return out, lse


def _slot_rows(idx: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Flat target row (b * S + index) of every slot of idx [b, t, K]; -1 slots map to a dump row."""
    B = idx.shape[0]
    base = torch.arange(B, device=idx.device).view(B, 1, 1) * num_keys
    return torch.where(idx >= 0, idx.long() + base, torch.full_like(idx, B * num_keys, dtype=torch.long))


def latent_backward(q_lat, q_pe, c_kv, k_pe, idx, out, lse, d_out, scale: float, config: LaunchConfig,
                    tensor_cores: bool = False):
    """Gradients (dq_lat, dq_pe, dc_kv, dk_pe), all fp32 (``tensor_cores``: bf16 operands, d_out rounded to bf16)."""
    B, T, H, C = q_lat.shape
    S, DR, K = c_kv.shape[1], q_pe.shape[-1], idx.shape[-1]
    d_out = (d_out.to(torch.bfloat16) if tensor_cores else d_out.float()).contiguous()
    delta = (out * d_out.float()).sum(-1).contiguous()  # [B, T, H], from the d_out the kernels see
    meta = _meta(q_lat, q_pe, config, tensor_cores)
    strides = _key_strides(c_kv, k_pe, idx)
    dq_lat = torch.empty_like(q_lat, dtype=torch.float32)
    dq_pe = torch.empty_like(q_pe, dtype=torch.float32)
    _sparse_bwd_dq_kernel[(B * T, triton.cdiv(H, meta["BH"]))](
        q_lat, q_pe, c_kv, k_pe, idx, d_out, lse, delta, dq_lat, dq_pe, T, H, K, scale, *strides,
        **meta, **config.launch_kwargs())
    # Key side: per-slot gradients for a chunk of query rows, then a sorted accumulation.
    dkv = torch.zeros((B * S + 1, C), dtype=torch.float32, device=q_lat.device)  # last row: -1 slots
    dkr = torch.zeros((B * S + 1, DR), dtype=torch.float32, device=q_lat.device)
    targets = _slot_rows(idx, S).view(B * T, K)  # [R, K]
    rows_per_chunk = max(1, _SLOT_BUDGET // max(1, K * (C + DR)))
    for row0 in range(0, B * T, rows_per_chunk):
        n = min(rows_per_chunk, B * T - row0)
        dkv_slots = torch.empty((n, K, C), dtype=torch.float32, device=q_lat.device)
        dkr_slots = torch.empty((n, K, DR), dtype=torch.float32, device=q_lat.device)
        _sparse_bwd_dkv_kernel[(n, triton.cdiv(K, meta["BK"]))](
            q_lat, q_pe, c_kv, k_pe, idx, d_out, lse, delta, dkv_slots, dkr_slots, row0, T, H, K, scale,
            *strides, **meta, **config.launch_kwargs())
        flat = targets[row0:row0 + n].reshape(-1)  # [n * K]
        dkv.index_put_((flat,), dkv_slots.view(n * K, C), accumulate=True)
        if DR:  # NoPE (qk_rope_head_dim = 0): no rope key, nothing to accumulate
            dkr.index_put_((flat,), dkr_slots.view(n * K, DR), accumulate=True)
    return dq_lat, dq_pe, dkv[:-1].view(B, S, C), dkr[:-1].view(B, S, DR)


def _tensor_core_operands(q_lat, q_pe, c_kv, k_pe, tensor_cores: bool):
    """The operands the kernels read: all bf16 for the tensor-core path, else as given."""
    if not tensor_cores:
        return q_lat, q_pe, c_kv, k_pe
    return tuple(t.to(torch.bfloat16).contiguous() for t in (q_lat, q_pe, c_kv, k_pe))


class _SparseLatentAttention(torch.autograd.Function):
    """o_lat of fp32 q_lat / q_pe (so their gradients stay fp32) and c_kv / k_pe as given."""

    @staticmethod
    def forward(ctx, q_lat, q_pe, c_kv, k_pe, idx, scale, config, tensor_cores):
        operands = _tensor_core_operands(q_lat, q_pe, c_kv, k_pe, tensor_cores)
        out, lse = latent_forward(*operands, idx, scale, config, tensor_cores)
        ctx.save_for_backward(*operands, idx, out, lse)
        ctx.scale, ctx.config, ctx.tensor_cores = scale, config, tensor_cores
        return out

    @staticmethod
    def backward(ctx, d_out):
        q_lat, q_pe, c_kv, k_pe, idx, out, lse = ctx.saved_tensors
        grads = latent_backward(q_lat, q_pe, c_kv, k_pe, idx, out, lse, d_out, ctx.scale, ctx.config,
                                ctx.tensor_cores)
        return (*grads, None, None, None, None)


def _latent_inputs(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx):
    """fp32 contiguous latent-level operands (the reference computes in fp32 too)."""
    q_lat = absorb_query(q_nope.float(), w_uk.float()).contiguous()  # [B, T, H, C]
    return q_lat, q_pe.float().contiguous(), c_kv.contiguous(), k_pe.contiguous(), topk_idx.contiguous()


def uses_tensor_cores(q_nope, q_pe, c_kv, k_pe) -> bool:
    """bf16 activations and cache: the prefill's products run on bf16 tensor cores (fp32 accumulation);
    fp32 / fp16 inputs keep exact fp32 products."""
    return all(t.dtype == torch.bfloat16 for t in (q_nope, q_pe, c_kv, k_pe))


def sparse_prefill(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float, config: LaunchConfig):
    """``dsa_sparse_prefill``: differentiable in q_nope, q_pe, c_kv, k_pe, w_uk, w_uv."""
    tensor_cores = uses_tensor_cores(q_nope, q_pe, c_kv, k_pe)
    if not tensor_cores:
        c_kv, k_pe = c_kv.float(), k_pe.float()
    q_lat, q_pe32, c_kv, k_pe, idx = _latent_inputs(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx)
    o_lat = _SparseLatentAttention.apply(q_lat, q_pe32, c_kv, k_pe, idx, float(scale), config, tensor_cores)
    return project_output(o_lat, w_uv.float()).to(q_nope.dtype)


def sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float, config: LaunchConfig):
    """``dsa_sparse_decode``: inference only (no autograd graph through the kernel)."""
    q_lat, q_pe32, c_kv, k_pe, idx = _latent_inputs(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx)
    o_lat, _ = latent_forward(q_lat, q_pe32, c_kv, k_pe, idx, float(scale), config)
    return project_output(o_lat, w_uv.float()).to(q_nope.dtype)


def dense_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale: float, start_pos, config: LaunchConfig):
    """``mla_decode`` as sparse attention over every causal key: idx [B, T, S] selects 0..pos, -1 after."""
    B, T = q_nope.shape[:2]
    S = c_kv.shape[1]
    pos = _util.start_tensor(start_pos, B, q_nope.device).long().view(B, 1) + torch.arange(T, device=q_nope.device)
    keys = torch.arange(S, device=q_nope.device, dtype=torch.int32).expand(B, T, S)  # [B, T, S]
    idx = torch.where(keys <= pos.unsqueeze(-1), keys, torch.full_like(keys, -1))
    return sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, idx, scale=scale, config=config)


_DENSE_DECODE_MAX_QUERIES = 64


def dense_decode_supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, **kwargs):
    if q_nope.shape[1] > _DENSE_DECODE_MAX_QUERIES:
        return False, f"T={q_nope.shape[1]} queries > {_DENSE_DECODE_MAX_QUERIES}: use mla_prefill for long chunks"
    return supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, torch.empty((1, 1, 1)), **kwargs)


def supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, launch: LaunchConfig = None,
             shared_memory_limit: int = None, **kwargs):
    """``launch`` / ``shared_memory_limit`` (bound by the kernel table): decline latent / rope widths whose fp32
    tiles (the widest the kernels hold) would not fit the vendor's shared memory per block."""
    why = _util.float_dtype_verdict("q_nope", q_nope)
    if why:
        return False, why
    if c_kv.shape[-1] > 1024 or q_pe.shape[-1] > 256:
        return False, f"latent width C={c_kv.shape[-1]} > 1024 or rope dim {q_pe.shape[-1]} > 256"
    if topk_idx.shape[-1] == 0:
        return False, "no selected keys (K=0)"
    if launch is not None and shared_memory_limit is not None:
        dims = dataclasses.replace(shared_memory.GLM5_DIMS, latent=c_kv.shape[-1], rope=q_pe.shape[-1])
        why = shared_memory.over_limit("sparse_mla", launch, shared_memory_limit, dims)
        if why:
            return False, f"latent width C={c_kv.shape[-1]}, rope dim {q_pe.shape[-1]}: {why}"
    return True, ""


def fitting(hook, configs: KernelConfigs):
    """``hook`` (``supports`` / ``dense_decode_supports``) with the vendor's launch and shared-memory limit bound."""
    return functools.partial(hook, launch=configs.get(FAMILY, DEFAULT_LAUNCH),
                             shared_memory_limit=configs.shared_memory_limit)


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "sparse_mla"  # this module's launch configuration
# the launch unless the vendor overrides it
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 16, "keys": 32})
ITEMSIZES = (4, 2)  # the fp32 path and the bf16 tensor-core path


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    """itemsize 4: the fp32 path (keys widened to fp32); 2: the bf16 tensor-core path (every operand bf16)."""
    BH, BK = blocks["heads"], blocks["keys"]
    C, DR = _util.next_pow2(dims.latent, 16), _util.next_pow2(dims.rope, 16)
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


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    """op -> kernel (``custom_ops`` then wraps dsa_sparse_decode as a torch.library op)."""
    config = configs.get(FAMILY, DEFAULT_LAUNCH)
    return {
        "dsa_sparse_prefill": bind(sparse_prefill, config, fitting(supports, configs),
                                   differentiable=True),  # backward through _SparseLatentAttention
        "dsa_sparse_decode": bind(sparse_decode, config, fitting(supports, configs)),
        "mla_decode": bind(dense_decode, config, fitting(dense_decode_supports, configs)),
    }
