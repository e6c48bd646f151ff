"""cpu backend kernel for KDA's chunked form (``kda_chunked``), written in torch ops (no extension needed), with
its backward by autograd through them.

Legend as in ``glm5_core.ops.kda``; here per (batch row, head): N chunks of C tokens, Gamma the in-chunk cumulative
sum of g.

What differs from the reference (which handles one chunk at a time and builds the pairwise decays
exp(Gamma_i - Gamma_j) as a [C, C, K] tensor per chunk):
  * every chunk's in-chunk matrices at once ([B, H, N, C, C]), the state loop alone left sequential;
  * no pairwise [.., C, C, K] tensor: the strictly lower triangle splits by halving into square blocks, each one
    product through its first row r: sum_d (k_id exp(Gamma_id - Gamma_rd)) (k_jd exp(Gamma_rd - Gamma_jd)),
    one batched GEMM per level (``_in_chunk_matrices``). For g <= 0 both factors are <= 1 (i >= r > j), so
    nothing overflows; inputs with g > 0 anywhere are declined (the reference, which exponentiates only whole
    differences, runs). log2(C) levels of O(C K) exponentials per chunk instead of the C x 16 x K pairwise decays
    on 16 x 16 diagonal blocks the kernel had before (session 14: 2.5x less time at B 1, T 256, H 4, K 64);
  * one triangular solve for both right-hand sides (the decayed keys and the values), all chunks batched.
Deterministic: the same torch ops in the same order, no atomics; bitwise across runs and thread counts is
tested (tests/ops/test_kda.py).

This torch-ops kernel stays the cpu kernel of ``kda_chunked`` (whether or not the C++ extension builds): no C++
chunked kernel exists yet. Its time is the batched GEMMs and the triangular solve (oneDNN / MKL already), with only
the per-chunk state recurrence left sequential, so a C++ port would mostly save Python dispatch; one that beats it
has not been written (the recurrent form and the conv are native: ``kda_native.py``, csrc/cpu_kda.cpp).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import kda as ops
from glm5_core.ops.kda import _initial, _pad_chunks, _prepare


def _in_chunk_matrices(q, k, G):
    """(kk strictly lower, qk lower with the diagonal) [B, H, N, C, C] from q, k, Gamma [B, H, N, C, K].

    The strictly lower triangle of a chunk (C padded to a power of two P: zero keys and queries, Gamma held at its
    last value) splits into square blocks by halving: at level s (P / 2, P / 4, .., 1) the P / (2 s) blocks of rows
    [(2m + 1) s, (2m + 2) s) and columns [2m s, (2m + 1) s), each one product through its first row r:
    sum_d (k_id exp(Gamma_id - Gamma_rd)) (k_jd exp(Gamma_rd - Gamma_jd)), both factors <= 1 for g <= 0
    (i >= r > j). All blocks of a level are one batched GEMM (at s <= 4 as fast as products and sums); the
    diagonal of qk is q_i . k_i (its decay is exp(0) = 1)."""
    C, K = k.shape[-2], k.shape[-1]
    P = 1 << (C - 1).bit_length()
    lead = k.shape[:-2]
    if P != C:
        pad = k.new_zeros(*lead, P - C, K)
        k, q = torch.cat([k, pad], -2), torch.cat([q, pad], -2)
        G = torch.cat([G, G[..., -1:, :].expand(*lead, P - C, K)], -2)
    kk = k.new_zeros(*lead, P, P)
    qk = k.new_zeros(*lead, P, P)
    s = P // 2
    while s >= 1:
        M = P // (2 * s)
        Gv, kv, qv = (t.reshape(*lead, M, 2, s, K) for t in (G, k, q))  # [.., block m, half, row, K]
        Gr = Gv[..., 1, :1, :]  # [.., M, 1, K]: Gamma at each block's first row
        right = kv[..., 0, :, :] * (Gr - Gv[..., 0, :, :]).exp()  # [.., M, s, K], <= |k|
        if s > 1:
            left = (Gv[..., 1, :, :] - Gr).exp()  # [.., M, s, K], <= 1
            kl, ql = kv[..., 1, :, :] * left, qv[..., 1, :, :] * left
        else:  # one row: its own first row, exp(0) = 1
            kl, ql = kv[..., 1, :, :], qv[..., 1, :, :]
        rT = right.transpose(-1, -2)
        blocks = [kl @ rT, ql @ rT]  # [.., M, s, s]
        for mat, blk in zip((kk, qk), blocks):  # the M blocks of [P, P] seen as [M, 2, s, M, 2, s]: (m, 1, m, 0)
            mat.view(*lead, M, 2, s, M, 2, s).diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :].copy_(
                blk.movedim(-3, -1))
        s //= 2
    qk.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    return kk[..., :C, :C], qk[..., :C, :C]


def chunked(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None, output_final_state: bool = False,
            chunk_size: int = ops.DEFAULT_CHUNK_SIZE, use_qk_l2norm: bool = False):
    """KDA in the chunked form (module docstring). Returns (o [B, T, H, V] in q's dtype, final state or None)."""
    out_dtype = q.dtype
    q, k, v, g, beta, ct = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    S = _initial(initial_state, B, H, K, V, ct, q.device)
    q, k, v, g = (_pad_chunks(t, T, C) for t in (q, k, v, g))  # [B, H, N, C, .]
    beta = _pad_chunks(beta, T, C).unsqueeze(-1)  # [B, H, N, C, 1]
    G = g.cumsum(dim=-2)
    kk, qk = _in_chunk_matrices(q, k, G)
    unit = torch.eye(C, dtype=ct, device=q.device) + beta * kk  # I + L
    rhs = torch.cat([beta * k * G.exp(), beta * v], dim=-1)  # [B, H, N, C, K + V]
    solved = torch.linalg.solve_triangular(unit, rhs, upper=False, unitriangular=True)
    w, u = solved[..., :K], solved[..., K:]  # U = u - w S0 per chunk
    q_decayed = q * G.exp()
    last = G[..., -1:, :]  # [B, H, N, 1, K]
    k_to_end = (k * (last - G).exp()).transpose(-1, -2)  # [B, H, N, K, C]
    end_decay = last.transpose(-1, -2).exp()  # [B, H, N, K, 1]
    outs = []
    for n in range(q.shape[2]):
        U = u[:, :, n] - w[:, :, n] @ S
        outs.append(q_decayed[:, :, n] @ S + qk[:, :, n] @ U)
        S = S * end_decay[:, :, n] + k_to_end[:, :, n] @ U
    o = torch.stack(outs, dim=2).reshape(B, H, -1, V)[:, :, :T].movedim(1, 2)
    return o.to(out_dtype), (S if output_final_state else None)


def _supports(q, k, v, g, beta, **kwargs):
    if q.device.type != "cpu":
        return False, f"the cpu kernel needs CPU tensors, got {q.device}"
    if g.numel() and bool((g > 0).any()):
        return False, "g has entries > 0 (a growing state): the kernel's factored decays assume g <= 0"
    return True, ""


KERNELS: Mapping[str, Kernel] = {"kda_chunked": Kernel(chunked, supports=_supports, differentiable=True)}
