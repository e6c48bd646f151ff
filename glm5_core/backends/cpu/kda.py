"""cpu backend kernel for KDA's chunked form (``kda_chunked``), written in torch ops (no extension needed), with
its backward by autograd through them.

Legend as in ``glm5_core.ops.kda``; here per (batch row, head): N chunks of C tokens, Gamma the in-chunk cumulative
sum of g, SB the sub-block size (16 when it divides C, else C).

What differs from the reference (which handles one chunk at a time and builds the pairwise decays
exp(Gamma_i - Gamma_j) as a [C, C, K] tensor per chunk):
  * every chunk's in-chunk matrices at once ([B, H, N, C, C]), the state loop alone left sequential;
  * the pairwise [.., C, C, K] tensor only on the SB x SB diagonal blocks. A row block starting at row r takes
    the columns before it as one GEMM: sum_d (k_id exp(Gamma_id - Gamma_rd)) (k_jd exp(Gamma_rd - Gamma_jd)).
    For g <= 0 both factors are <= 1 (i >= r > j), so nothing overflows; inputs with g > 0 anywhere are declined
    (the reference, which exponentiates only whole differences, runs);
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

SUB_BLOCK = 16


def _in_chunk_matrices(q, k, G, sb: int):
    """(kk strictly lower, qk lower with the diagonal) [B, H, N, C, C] from q, k, Gamma [B, H, N, C, K]."""
    C = k.shape[-2]
    kk = k.new_zeros(*k.shape[:-1], C)
    qk = k.new_zeros(*k.shape[:-1], C)
    tri = torch.tril(torch.ones(sb, sb, dtype=torch.bool, device=k.device))  # j <= i inside a block
    for r in range(0, C, sb):
        rows = slice(r, r + sb)
        Gb = G[..., rows, :]  # [.., sb, K]
        # the diagonal block: pairwise decays (j <= i), [.., sb, sb, K]
        decay = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~tri.unsqueeze(-1), float("-inf")).exp()
        kb = k[..., rows, :]
        kd = kb.unsqueeze(-3) * decay  # k_j exp(Gamma_i - Gamma_j), [.., sb (i), sb (j), K]
        kk[..., rows, rows] = (kb.unsqueeze(-2) * kd).sum(-1)
        qk[..., rows, rows] = (q[..., rows, :].unsqueeze(-2) * kd).sum(-1)
        if r:  # the columns before the block: one GEMM through the block's first row
            Gr = Gb[..., :1, :]  # [.., 1, K]
            left = (Gb - Gr).exp()  # [.., sb, K], <= 1
            right = k[..., :r, :] * (Gr - G[..., :r, :]).exp()  # [.., r, K], <= 1
            kk[..., rows, :r] = (kb * left) @ right.transpose(-1, -2)
            qk[..., rows, :r] = (q[..., rows, :] * left) @ right.transpose(-1, -2)
    return kk.tril(-1), qk


def chunked(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None, output_final_state: bool = False,
            chunk_size: int = ops.DEFAULT_CHUNK_SIZE, use_qk_l2norm: bool = False):
    """KDA in the chunked form (module docstring). Returns (o [B, T, H, V] in q's dtype, final state or None)."""
    out_dtype = q.dtype
    q, k, v, g, beta, ct = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    sb = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    S = _initial(initial_state, B, H, K, V, ct, q.device)
    q, k, v, g = (_pad_chunks(t, T, C) for t in (q, k, v, g))  # [B, H, N, C, .]
    beta = _pad_chunks(beta, T, C).unsqueeze(-1)  # [B, H, N, C, 1]
    G = g.cumsum(dim=-2)
    kk, qk = _in_chunk_matrices(q, k, G, sb)
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
