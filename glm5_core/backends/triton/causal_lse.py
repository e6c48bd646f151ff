"""Each head's log-sum-exp over every causal key, in MLA's absorbed form, as a Triton kernel (flash-style, no
probabilities kept): the "causal" normaliser of ``attention_target``.

Legend: B batch, T queries, S key slots, H heads, C latent width, Dr rope dim; BM / BS row / key tiles
(``config.block("rows")`` / ``("cols")``).

lse[b, t, h] = log sum_{s <= start[b] + t} exp(scale * (q_lat[b,t,h] . c_kv[b,s] + q_pe[b,t,h] . k_pe[b,s])).
The heads of a batch row share its keys, so its queries are one [T * H, C] matrix (row r = t * H + h of the
contiguous q_lat [B, T, H, C]): one program per (batch row, tile of BM such rows) streams the keys in blocks of BS
from slot 0 up to the last key its last row sees, scores each block with one [BM, C] x [C, BS] tl.dot (exact fp32
products) and keeps an online max / sum per row. Key 0 is visible to every query, so every lse is finite.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util
from glm5_core.backends.triton.launch import LaunchConfig


@triton.jit
def online_lse_step(m, total, s):
    """One block of scores s [N, BS] (-inf where masked) folded into the running max m [N] and sum of
    exp(score - m) total [N]: the new (m, total)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp() finite
    return m_new, total * tl.exp(m - m_ref) + tl.sum(tl.exp(s - m_ref[:, None]), axis=1)


@triton.jit
def finish_lse(m, total):
    """log sum exp from the running (m, total); +inf for a row that met no key (its every p is then 0), NaN where
    a score was NaN or +inf (a NaN total, as the reference's softmax gives: not "no key")."""
    no_key = total == 0.0
    return tl.where(no_key, float("inf"), m + tl.log(tl.where(no_key, 1.0, total)))


@triton.jit
def _rows(ptr, base, offs_r, mask_r, D: tl.constexpr, D_PAD: tl.constexpr):
    """Rows offs_r of the [N, D] matrix at ptr + base (contiguous) -> [BM, D_PAD] (0 past D / masked rows)."""
    offs_d = tl.arange(0, D_PAD)
    rows = offs_r.to(tl.int64)  # T * H * D can pass 2^31 elements: int32 offsets would wrap
    return tl.load(ptr + base + rows[:, None] * D + offs_d[None, :],
                   mask=mask_r[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)


@triton.jit
def _causal_lse_kernel(qlat_ptr, qpe_ptr, ckv_ptr, kpe_ptr, start_ptr, lse_ptr, T, H, S, scale,
                       stride_cb, stride_cs, stride_kb, stride_ks,
                       C: tl.constexpr, DR: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                       C_PAD: tl.constexpr, DR_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BM
    offs_r = r0 + tl.arange(0, BM)  # flat (query, head) rows of batch row b
    mask_r = offs_r < T * H
    start = tl.load(start_ptr + b)
    pos = start + offs_r // H  # the last key each row sees
    q_lat = _rows(qlat_ptr, b * T * H * C, offs_r, mask_r, C, C_PAD)  # [BM, C_PAD]
    q_pe = _rows(qpe_ptr, b * T * H * DR, offs_r, mask_r, DR, DR_PAD)  # [BM, DR_PAD]
    last_row = tl.minimum(r0 + BM, T * H) - 1
    n_keys = tl.minimum(S, start + last_row // H + 1)  # keys past the tile's last query are never scored
    offs_c = tl.arange(0, C_PAD)
    offs_p = tl.arange(0, DR_PAD)
    m = tl.full([BM], float("-inf"), tl.float32)
    total = tl.zeros([BM], tl.float32)
    for s0 in range(0, n_keys, BS):
        offs_s = s0 + tl.arange(0, BS)
        in_cache = offs_s < S
        kv = tl.load(ckv_ptr + b * stride_cb + offs_s[:, None] * stride_cs + offs_c[None, :],
                     mask=in_cache[:, None] & (offs_c[None, :] < C), other=0.0).to(tl.float32)  # [BS, C_PAD]
        kr = tl.load(kpe_ptr + b * stride_kb + offs_s[:, None] * stride_ks + offs_p[None, :],
                     mask=in_cache[:, None] & (offs_p[None, :] < DR), other=0.0).to(tl.float32)  # [BS, DR_PAD]
        s = tl.dot(q_lat, tl.trans(kv), input_precision="ieee") + tl.dot(q_pe, tl.trans(kr), input_precision="ieee")
        s = tl.where(offs_s[None, :] <= pos[:, None], s * scale, float("-inf"))  # [BM, BS]
        m, total = online_lse_step(m, total, s)
    tl.store(lse_ptr + b * T * H + offs_r, finish_lse(m, total), mask=mask_r)  # (padded rows: +inf, not stored)


def causal_lse(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               start: torch.Tensor, *, scale: float, config: LaunchConfig) -> torch.Tensor:
    """lse [B, T, H] fp32 of every head over its causal keys; q_lat [B, T, H, C] and q_pe [B, T, H, Dr] contiguous
    fp32, c_kv [B, S, C] / k_pe [B, S, Dr] with unit last strides, start [B] int32 (query t sits at start + t)."""
    B, T, H, C = q_lat.shape
    S, DR = c_kv.shape[1], q_pe.shape[-1]
    assert q_lat.is_contiguous() and q_pe.is_contiguous() and c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1
    lse = torch.empty((B, T, H), dtype=torch.float32, device=q_lat.device)
    BM = config.block("rows")
    _causal_lse_kernel[(B, triton.cdiv(T * H, BM))](
        q_lat, q_pe, c_kv, k_pe, start, lse, T, H, S, scale, c_kv.stride(0), c_kv.stride(1), k_pe.stride(0),
        k_pe.stride(1), C=C, DR=DR, BM=BM, BS=config.block("cols"), C_PAD=_util.next_pow2(C, 16),
        DR_PAD=_util.next_pow2(DR, 16), **config.launch_kwargs())
    return lse
