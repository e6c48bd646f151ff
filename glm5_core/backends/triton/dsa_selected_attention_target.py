"""``dsa_selected_attention_target`` (the sparse stage's indexer-KL target at the selected keys) as Triton kernels.

Legend as in ``glm5_core.ops.selected_attention_target``; R = B * T query rows, BH / BK head / key tiles
(``config.block("heads")`` / ``("keys")``).

The target p[b,t,j] = (1/H) sum_h exp(score_h[t, i_j] - lse_h[t]), score_h = scale * (q_nope . k_nope + q_pe .
k_pe), 0 where i_j = -1 or key i_j is past the query (start[b] + t). The kernels score in MLA's absorbed form,
q_lat . c_kv[i_j] + q_pe . k_pe[i_j] with q_lat = q_nope W_UK (fp32, torch): the heads of a query share its
gathered latent rows, so one [BK, C] gather serves every head and the scores are a [BH, C] x [C, BK] tl.dot
(as in ``sparse_mla``), where the expanded form would gather H * Dn values per key. A ``k_nope`` argument is
c_kv W_UK^T by the op's contract and is not read: the values agree to rounding (the reference's docstring).

Two launches per call, keys past the query dropped first (their slots set to -1, in torch, O(T K)):
  1. lse [R, H] of each head over what ``normaliser`` names:
       "selected": the row's valid selected keys; one program per (query row, head tile) walks the row's K slots
       in tiles of BK with an online max / sum; +inf for a row with no valid key (its every p is 0).
       "causal": every causal key, the flash-style pass of ``causal_lse``.
  2. the target: one program per (query row, key tile) gathers its BK latent rows once and loops over the head
     tiles in head order, summing exp(score - lse) over heads; the sum / H is written to its own slots.
Products are exact fp32 for every input dtype (16-bit tiles are widened); lse and sums are fp32. No atomics and
a fixed order of every sum: the result is bitwise repeatable. fp64 inputs are declined (the fp64 reference runs).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util, causal_lse, shared_memory
from glm5_core.backends.triton.causal_lse import finish_lse, online_lse_step
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.backends.triton.sparse_mla import _gather_keys, _key_strides, _load_heads, _mm, _row_and_heads
from glm5_core.kernel import Kernel
from glm5_core.ops.mla import absorb_query


@triton.jit
def _selected_scores(q_lat, q_pe, kv, kr, valid, scale):
    """scale * (q_lat . kv + q_pe . kr) [BH, BK] in exact fp32 products, -inf at invalid slots."""
    s = _mm(q_lat, tl.trans(kv), False, False) + _mm(q_pe, tl.trans(kr), False, False)
    return tl.where(valid[None, :], s * scale, float("-inf"))


@triton.jit
def _selected_lse_kernel(qlat_ptr, qpe_ptr, ckv_ptr, kpe_ptr, idx_ptr, lse_ptr, T, H, K, scale,
                         stride_cb, stride_cs, stride_kb, stride_ks, stride_ir,
                         C: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                         C_PAD: tl.constexpr, DR_PAD: tl.constexpr):
    row, b, h0, q_lat, q_pe = _row_and_heads(qlat_ptr, qpe_ptr, T, H, C, DR, BH, C_PAD, DR_PAD)
    m = tl.full([BH], float("-inf"), tl.float32)
    total = tl.zeros([BH], tl.float32)
    for k0 in range(0, K, BK):
        kv, kr, valid = _gather_keys(ckv_ptr, kpe_ptr, idx_ptr, b, row, k0, K, stride_cb, stride_cs,
                                     stride_kb, stride_ks, stride_ir, C, DR, BK, C_PAD, DR_PAD)
        s = _selected_scores(q_lat, q_pe, kv, kr, valid, scale)  # [BH, BK]
        m, total = online_lse_step(m, total, s)
    offs_h = h0 + tl.arange(0, BH)
    tl.store(lse_ptr + row * H + offs_h, finish_lse(m, total), mask=offs_h < H)


@triton.jit
def _target_kernel(qlat_ptr, qpe_ptr, ckv_ptr, kpe_ptr, idx_ptr, lse_ptr, out_ptr, T, H, K, scale,
                   stride_cb, stride_cs, stride_kb, stride_ks, stride_ir,
                   C: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                   C_PAD: tl.constexpr, DR_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    b = row // T
    kv, kr, valid = _gather_keys(ckv_ptr, kpe_ptr, idx_ptr, b, row, k0, K, stride_cb, stride_cs,
                                 stride_kb, stride_ks, stride_ir, C, DR, BK, C_PAD, DR_PAD)
    acc = tl.zeros([BK], tl.float32)
    for h0 in range(0, H, BH):  # fixed head order
        offs_h = h0 + tl.arange(0, BH)
        q_lat = _load_heads(qlat_ptr, row, h0, H * C, C, H, C, BH, C_PAD)
        q_pe = _load_heads(qpe_ptr, row, h0, H * DR, DR, H, DR, BH, DR_PAD)
        lse = tl.load(lse_ptr + row * H + offs_h, mask=offs_h < H, other=float("inf"))  # +inf: p = 0
        s = _selected_scores(q_lat, q_pe, kv, kr, valid, scale)
        p = tl.where(valid[None, :] & (lse[:, None] != float("inf")), tl.exp(s - lse[:, None]), 0.0)  # NaN lse: NaN
        acc += tl.sum(p, axis=0)
    offs_k = k0 + tl.arange(0, BK)
    tl.store(out_ptr + row * K + offs_k, acc / H, mask=offs_k < K)


def visible_indices(topk_idx: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """topk_idx [B, T, K] int32 with -1 at the slots whose key is past its query (key > start[b] + t)."""
    B, T, _ = topk_idx.shape
    pos = start.long().view(B, 1) + torch.arange(T, device=topk_idx.device)  # [B, T]
    idx = topk_idx.to(torch.int32)
    return torch.where(idx.long() <= pos.unsqueeze(-1), idx, torch.full_like(idx, -1)).contiguous()


def _meta(C: int, DR: int, config: LaunchConfig):
    return dict(C=C, DR=DR, BH=config.block("heads"), BK=config.block("keys"), C_PAD=_util.next_pow2(C, 16),
                DR_PAD=_util.next_pow2(DR, 16))


@torch.no_grad()
def selected_attention_target(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, *, scale: float, start_pos,
                              k_nope=None, normaliser: str = "selected", config: LaunchConfig) -> torch.Tensor:
    """[B, T, K] fp32, the reference's contract for fp16 / bf16 / fp32 inputs (``k_nope`` not read: module
    docstring); O(T K H (C + Dr)) for "selected", plus O(T S H (C + Dr)) for "causal"'s log-sum-exp."""
    B, T, H, _ = q_nope.shape
    C, DR, K = c_kv.shape[-1], q_pe.shape[-1], topk_idx.shape[-1]
    out = torch.zeros((B, T, K), dtype=torch.float32, device=q_nope.device)
    if K == 0:
        return out
    q_lat = absorb_query(q_nope.detach().float(), w_uk.detach().float()).contiguous()  # [B, T, H, C]
    q_pe = q_pe.detach().float().contiguous()
    c_kv, k_pe = c_kv.detach().contiguous(), k_pe.detach().contiguous()
    start = _util.start_tensor(start_pos, B, q_nope.device)
    idx = visible_indices(topk_idx, start)
    meta = _meta(C, DR, config)
    args = (q_lat, q_pe, c_kv, k_pe, idx)
    strides = _key_strides(c_kv, k_pe, idx)
    if normaliser == "causal":
        lse = causal_lse.causal_lse(q_lat, q_pe, c_kv, k_pe, start, scale=float(scale), config=config)
    else:
        lse = torch.empty((B, T, H), dtype=torch.float32, device=q_nope.device)
        _selected_lse_kernel[(B * T, triton.cdiv(H, meta["BH"]))](*args, lse, T, H, K, float(scale), *strides,
                                                                   **meta, **config.launch_kwargs())
    _target_kernel[(B * T, triton.cdiv(K, meta["BK"]))](*args, lse, out, T, H, K, float(scale), *strides,
                                                         **meta, **config.launch_kwargs())
    return out


def supports(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, *, launch: LaunchConfig = None,
             shared_memory_limit: int = None, **kwargs):
    """Declines fp64 (the fp64 reference runs), latent / rope widths past the tiles, and (``launch`` /
    ``shared_memory_limit`` bound by the kernel table) widths whose fp32 tiles would not fit the vendor's shared
    memory per block."""
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("c_kv", c_kv), ("k_pe", k_pe), ("w_uk", w_uk)):
        why = _util.float_dtype_verdict(name, t)
        if why:
            return False, why
    if c_kv.shape[-1] > 1024 or q_pe.shape[-1] > 256:
        return False, f"latent width C={c_kv.shape[-1]} > 1024 or rope dim {q_pe.shape[-1]} > 256"
    if launch is not None and shared_memory_limit is not None:
        dims = dataclasses.replace(shared_memory.GLM5_DIMS, latent=c_kv.shape[-1], rope=q_pe.shape[-1])
        why = shared_memory.over_limit(FAMILY, launch, shared_memory_limit, dims)
        if why:
            return False, f"latent width C={c_kv.shape[-1]}, rope dim {q_pe.shape[-1]}: {why}"
    return True, ""


def fitting(configs: KernelConfigs):
    """``supports`` with the vendor's launch and shared-memory limit bound."""
    return functools.partial(supports, launch=configs.get(FAMILY, DEFAULT_LAUNCH),
                             shared_memory_limit=configs.shared_memory_limit)


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "dsa_selected_attention_target"  # this module's (and causal_lse's) launch configuration
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=1,  # unless the vendor overrides it
                              blocks={"heads": 16, "keys": 32, "rows": 32, "cols": 32})
ITEMSIZES = (4,)  # every operand is widened to fp32 before its dot, whatever the input dtype


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    BH, BK, BM, BS = blocks["heads"], blocks["keys"], blocks["rows"], blocks["cols"]
    C, DR = _util.next_pow2(dims.latent, 16), _util.next_pow2(dims.rope, 16)
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


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    config = configs.get(FAMILY, DEFAULT_LAUNCH)
    return {"dsa_selected_attention_target": bind(selected_attention_target, config, fitting(configs))}
