"""cpu backend kernels for DSA: the fused streaming indexer top-k and sparse MLA attention.

Each takes exactly the arguments of its reference (``glm5_core.ops.dsa``), already validated, and calls
the native ``torch.ops.glm5_cpu`` ops. Sparse prefill and sparse decode share one contract (absorbed MLA
over the selected latent rows, any number of queries) and one forward kernel; a prefill that needs gradients
(training) goes through the native backward ``sparse_prefill_backward`` (csrc/cpu_sparse_prefill_backward.cpp),
which touches the selected rows only: O(T K) time and memory, never O(T S). The expanded form
(``dsa_sparse_prefill_expanded``: per-head keys and values, csrc/cpu_sparse_expanded.cpp) has its own native
forward and backward. The query absorption and the
output projection stay torch ops (autograd differentiates them). The indexer top-k returns indices, which
carry no gradient: it runs natively whatever its inputs require. The indexer scores at the selected keys (the
sparse stage's KL) have a native forward and backward over the selected rows
(csrc/cpu_selected_index_scores.cpp). Legend as in ``glm5_core.ops.dsa``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks
from glm5_core.ops import kpool_topk as kpool_topk_ops
from glm5_core.ops.mla import absorb_query, project_output


def _on_cpu(*tensors) -> tuple[bool, str]:
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices != {"cpu"}:
        return False, f"native CPU kernels need CPU tensors, got {sorted(devices)}"
    return True, ""


def _start_tensor(start_pos, batch: int) -> torch.Tensor:
    if isinstance(start_pos, torch.Tensor):
        return start_pos.to(torch.int64)
    return torch.full((batch,), int(start_pos), dtype=torch.int64)  # [B]


def indexer_topk(q, k, w, *, topk: int, start_pos=0) -> torch.Tensor:
    """int32 [B, T, topk]: the top-k contract, computed without materialising the [B, T, S] scores."""
    ct = _checks.compute_dtype(q.dtype)
    return torch.ops.glm5_cpu.indexer_topk(q.to(ct), k.to(ct), w.to(ct), _start_tensor(start_pos, q.shape[0]), topk)


def _indexer_supports(q, k, w, *, topk: int, start_pos=0):
    return _on_cpu(q, k, w, start_pos)


def kpool_topk(q, k, w, gate, ape, *, topk: int, kpool: int, select_tail: bool, scale: float,
               start_pos=0) -> torch.Tensor:
    """``dsa_kpool_topk``: the pooled keys (``kpool_topk.pool_keys``, elementwise torch ops), the native top-k
    over the pools (``indexer_topk`` with ``pool`` = kpool: pool j visible once its last token is), then the
    shared expansion to token indices and the tail."""
    ct = _checks.compute_dtype(q.dtype)
    B, T = q.shape[:2]
    pooled = kpool_topk_ops.pool_keys(k, gate, ape, kpool)  # [B, P, D] in ct
    P = pooled.shape[1]
    if P == 0:  # no complete pool yet: only the tail
        pools = torch.full((B, T, 1), -1, dtype=torch.int32, device=q.device)
    else:
        pools = torch.ops.glm5_cpu.indexer_topk(q.to(ct), pooled, w.to(ct) * scale,
                                                _start_tensor(start_pos, B), min(topk // kpool, P), kpool)
    return kpool_topk_ops.expand(pools, start_pos, topk=topk, kpool=kpool, select_tail=select_tail)


def _kpool_supports(q, k, w, gate, ape, **kwargs):
    return _on_cpu(q, k, w, gate, ape, kwargs.get("start_pos", 0))


def sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float) -> torch.Tensor:
    """[B, T, Hm, Dv]: absorbed MLA over the selected latent rows, read in place from the cache."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_lat = absorb_query(q_nope.to(ct), w_uk.to(ct))  # [B, T, Hm, C]
    o_lat = torch.ops.glm5_cpu.sparse_decode(q_lat, q_pe.to(ct), c_kv, k_pe, topk_idx, float(scale))  # [B, T, Hm, C]
    return project_output(o_lat, w_uv.to(ct)).to(out_dtype)


def _sparse_supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float):
    return _on_cpu(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx)


class _SparseLatentAttention(torch.autograd.Function):
    """o_lat [B, T, Hm, C] from the native forward; the backward recomputes the softmax over the selected rows
    (nothing [T, K]-sized is kept between the passes) and returns d q_lat, d q_pe, d c_kv, d k_pe."""

    @staticmethod
    def forward(ctx, q_lat, q_pe, c_kv, k_pe, topk_idx, scale):
        ctx.save_for_backward(q_lat, q_pe, c_kv, k_pe, topk_idx)
        ctx.scale = scale
        return torch.ops.glm5_cpu.sparse_decode(q_lat, q_pe, c_kv, k_pe, topk_idx, scale)

    @staticmethod
    def backward(ctx, grad_o_lat):
        q_lat, q_pe, c_kv, k_pe, topk_idx = ctx.saved_tensors
        d_q_lat, d_q_pe, d_c_kv, d_k_pe = torch.ops.glm5_cpu.sparse_prefill_backward(
            grad_o_lat.to(q_lat.dtype).contiguous(), q_lat, q_pe, c_kv, k_pe, topk_idx, ctx.scale)
        return d_q_lat, d_q_pe, d_c_kv.to(c_kv.dtype), d_k_pe.to(k_pe.dtype), None, None


def sparse_prefill(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float) -> torch.Tensor:
    """[B, T, Hm, Dv]: the same forward kernel as decode (rows are independent queries, batch invariant), so an
    inference prefill and the decode steps after it compute every query the same way; differentiable through
    the native backward when gradients are needed."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))):
        return sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, scale=scale)
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_lat = absorb_query(q_nope.to(ct), w_uk.to(ct))  # [B, T, Hm, C]
    o_lat = _SparseLatentAttention.apply(q_lat, q_pe.to(ct), c_kv, k_pe, topk_idx, float(scale))  # [B, T, Hm, C]
    return project_output(o_lat, w_uv.to(ct)).to(out_dtype)


class _SelectedIndexScores(torch.autograd.Function):
    """I_sel [B, T, K] from the native forward; the backward recomputes the dot products of the selected keys
    (nothing [T, K, H]-sized is kept between the passes) and returns d q, d k, d w."""

    @staticmethod
    def forward(ctx, q, k, w, topk_idx):
        ctx.save_for_backward(q, k, w, topk_idx)
        return torch.ops.glm5_cpu.selected_index_scores(q, k, w, topk_idx)

    @staticmethod
    def backward(ctx, grad):
        q, k, w, topk_idx = ctx.saved_tensors
        dq, dk, dw = torch.ops.glm5_cpu.selected_index_scores_backward(grad.to(q.dtype).contiguous(), q, k, w,
                                                                       topk_idx)
        return dq, dk, dw, None


def selected_index_scores(q, k, w, topk_idx) -> torch.Tensor:
    """[B, T, K] in the compute dtype, -inf at the -1 slots: the reference's contract, differentiable natively."""
    ct = _checks.compute_dtype(q.dtype)
    return _SelectedIndexScores.apply(q.to(ct), k.to(ct), w.to(ct), topk_idx)


def _selected_supports(q, k, w, topk_idx):
    return _on_cpu(q, k, w, topk_idx)


class _SparseExpandedAttention(torch.autograd.Function):
    """out [B, T, Hm, Dv] from the native expanded forward, which also gives the per-head log-sum-exp [B, T, Hm];
    the backward recomputes p from it over the selected rows (nothing [T, K]-sized kept between the passes), takes
    D = dO . out per head from the saved output (so one pass over a query's keys gives its gradients) and returns
    d q_nope, d q_pe, d k_nope, d k_pe, d v (csrc/cpu_sparse_expanded.cpp)."""

    @staticmethod
    def forward(ctx, q_nope, q_pe, k_nope, k_pe, v, topk_idx, scale):
        out, lse = torch.ops.glm5_cpu.sparse_expanded_forward(q_nope, q_pe, k_nope, k_pe, v, topk_idx, scale)
        ctx.save_for_backward(q_nope, q_pe, k_nope, k_pe, v, topk_idx, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_nope, q_pe, k_nope, k_pe, v, topk_idx, out, lse = ctx.saved_tensors
        grads = torch.ops.glm5_cpu.sparse_expanded_backward(grad_out.to(q_nope.dtype).contiguous(), q_nope, q_pe,
                                                             k_nope, k_pe, v, topk_idx, out, lse, ctx.scale)
        d_q_nope, d_q_pe, d_k_nope, d_k_pe, d_v = grads
        return d_q_nope, d_q_pe, d_k_nope.to(k_nope.dtype), d_k_pe.to(k_pe.dtype), d_v.to(v.dtype), None, None


def sparse_prefill_expanded(q_nope, q_pe, k_nope, k_pe, v, topk_idx, *, scale: float) -> torch.Tensor:
    """[B, T, Hm, Dv]: expanded-form MLA over the selected per-head keys (read in place, through their strides:
    k_nope and v may be views of one kv_b_proj output); differentiable through the native backward."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_nope, q_pe, k_nope, k_pe, v)):
        out = _SparseExpandedAttention.apply(q_nope.to(ct), q_pe.to(ct), k_nope, k_pe, v, topk_idx, float(scale))
    else:
        out, _ = torch.ops.glm5_cpu.sparse_expanded_forward(q_nope.to(ct), q_pe.to(ct), k_nope, k_pe, v, topk_idx,
                                                           float(scale))
    return out.to(out_dtype)


def _sparse_expanded_supports(q_nope, q_pe, k_nope, k_pe, v, topk_idx, *, scale: float):
    return _on_cpu(q_nope, q_pe, k_nope, k_pe, v, topk_idx)


KERNELS: Mapping[str, Kernel] = {
    "dsa_indexer_topk": Kernel(indexer_topk, supports=_indexer_supports),
    "dsa_kpool_topk": Kernel(kpool_topk, supports=_kpool_supports),
    "dsa_sparse_decode": Kernel(sparse_decode, supports=_sparse_supports),
    # native backward (sparse_prefill_backward) over the selected rows only
    "dsa_sparse_prefill": Kernel(sparse_prefill, supports=_sparse_supports, differentiable=True),
    # native backward (selected_index_scores_backward) over the selected keys only
    "dsa_selected_index_scores": Kernel(selected_index_scores, supports=_selected_supports, differentiable=True),
    "dsa_sparse_prefill_expanded": Kernel(sparse_prefill_expanded, supports=_sparse_expanded_supports,
                                          differentiable=True),
}
