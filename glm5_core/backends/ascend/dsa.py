"""DSA on Ascend: the lightning indexer's top-k (npu_lightning_indexer) and sparse MLA attention
(npu_sparse_flash_attention in MLA-absorbed mode). Layout work lives in ``dsa_layouts``.

Legend: B batch, T queries, S key slots, H indexer heads, D index head dim, K top-k, Hm attention heads,
C latent width, Dr rope width, Dv value head dim.

Our top-k contract vs the vendor op, and how the difference is bridged:
  * padding: both pad rows with fewer visible keys than k with -1 (nothing to convert);
  * dtype: vendor int32, ours int32; positions are row-local in both BSND and TND layouts;
  * tie order: ours is "score descending, ties to the LOWER key index"; the vendor documents no order
    among equal scores. We ask for k + 1 candidates (when k < 2048), re-score the candidates in fp32
    (the reference formula, head order) and sort them stably by (score desc, index asc). A row whose
    (k+1)-th candidate ties with its k-th may have tied keys outside the vendor's list, so exactly those
    rows are recomputed by the reference. With k = 2048 (the vendor's maximum) no extra candidate can be
    requested and which keys tied *at* the 2048th place are kept is the vendor's choice (docs/ascend.md,
    known deviations); the order inside the selection is still ours.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from glm5_core.backends.ascend import dsa_layouts as L
from glm5_core.backends.ascend.vendor import (
    HALF_DTYPES,
    OK,
    Decision,
    dtype_in,
    first_output,
    npu_kernel,
    vendor_ops,
)
from glm5_core.kernel import Kernel
from glm5_core.ops.dsa import indexer_topk_reference
from glm5_core.ops.mla import project_output

SPARSE_ATTENTION_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SPARSE_ATTENTION_LATENT = 512
SPARSE_ATTENTION_ROPE = 64


# ------------------------------------------------------------------------------------------ indexer top-k
def indexer_topk_limits(q, k, w, *, topk: int, start_pos=0) -> Decision:
    """npu_lightning_indexer's documented limits (op-plugin/docs/context/torch_npu-npu_lightning_indexer.md)."""
    op = "npu_lightning_indexer"
    B, T, H, D = q.shape
    if D != L.VENDOR_INDEX_HEAD_DIM:
        return False, f"{op} needs index head dim {L.VENDOR_INDEX_HEAD_DIM}, got {D}"
    if H > L.VENDOR_QUERY_HEADS:
        return False, f"{op} takes at most {L.VENDOR_QUERY_HEADS} query heads, got {H}"
    if topk > L.MAX_SPARSE_COUNT:
        return False, f"{op} returns at most sparse_count={L.MAX_SPARSE_COUNT} keys, got topk={topk}"
    decision = dtype_in("q / k", q, HALF_DTYPES, op)
    if not decision[0]:
        return decision
    if w.dtype != q.dtype and not torch.equal(w.to(q.dtype).to(w.dtype), w):
        return False, (f"{op} takes weights in the query dtype ({q.dtype}); these {w.dtype} weights do not "
                       f"convert exactly, so the selection would change")
    return OK


def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, topk: int, start_pos=0,
                 npu: Optional[object] = None) -> torch.Tensor:
    """int32 [B, T, topk] under the top-k contract of ``glm5_core.ops.dsa``."""
    ops = vendor_ops(npu)
    call = L.indexer_call(q, k, w, start_pos, sparse_count=min(topk + 1, L.MAX_SPARSE_COUNT))
    raw = first_output(ops.npu_lightning_indexer(call.query, call.key, call.weights, **call.kwargs()))
    cand = L.candidates_from_vendor(raw, call)  # [B, T, R] int64
    cand, scores = L.canonical_order(cand, L.rescore(q, k, w, cand))
    ambiguous = L.boundary_ties(scores, cand, topk)  # [B, T]
    out = cand[..., :topk].clone()  # [B, T, topk]
    if bool(ambiguous.any()):
        _recompute_rows(out, ambiguous, q, k, w, topk, start_pos)
    return out.to(torch.int32)


def _recompute_rows(out, rows, q, k, w, topk, start_pos) -> None:
    """Rows with a tie across the k-th place get the reference's answer (batch-invariant by construction)."""
    B, T = rows.shape
    pos = L.query_positions(start_pos, B, T, q.device)  # [B, T]
    for b, t in rows.nonzero().tolist():
        ref = indexer_topk_reference(q[b:b + 1, t:t + 1], k[b:b + 1], w[b:b + 1, t:t + 1], topk=topk,
                                     start_pos=int(pos[b, t]))  # [1, 1, topk]
        out[b, t] = ref[0, 0].to(out.dtype)


# ------------------------------------------------------------------------------ sparse flash attention
def sparse_attention_limits(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float) -> Decision:
    """npu_sparse_flash_attention's documented limits
    (op-plugin/docs/context/torch_npu-npu_sparse_flash_attention.md)."""
    op = "npu_sparse_flash_attention"
    Hm, C, Dr, K = q_nope.shape[2], c_kv.shape[-1], k_pe.shape[-1], topk_idx.shape[-1]
    if C != SPARSE_ATTENTION_LATENT or Dr != SPARSE_ATTENTION_ROPE:
        return False, (f"{op} (attention_mode=2) needs latent {SPARSE_ATTENTION_LATENT} + rope "
                       f"{SPARSE_ATTENTION_ROPE}, got {C} + {Dr}")
    if Hm not in SPARSE_ATTENTION_HEADS:
        return False, f"{op} takes {SPARSE_ATTENTION_HEADS} query heads, got {Hm}"
    if K < 1:
        return False, f"{op} needs sparse_size > 0, got topk_idx of width {K}"
    return dtype_in("q_nope", q_nope, HALF_DTYPES, op)


def sparse_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float,
                     npu: Optional[object] = None) -> torch.Tensor:
    """Absorbed MLA over the selected latent rows: [B, T, Hm, Dv] in the input dtype."""
    ops = vendor_ops(npu)
    call = L.sparse_attention_call(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, scale)
    o_lat = first_output(ops.npu_sparse_flash_attention(*call.args(), **call.kwargs()))  # [B, T, Hm, C]
    out = project_output(o_lat.float(), w_uv.float())  # [B, T, Hm, Dv]
    out = torch.where(call.has_key[:, :, None, None], out, torch.zeros_like(out))  # no key -> zeros
    return out.to(q_nope.dtype)


_SPARSE_ATTENTION = npu_kernel(
    sparse_attention, sparse_attention_limits,
    lambda q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, **kw: (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx),
    "npu_sparse_flash_attention")
KERNELS: Mapping[str, Kernel] = {
    "dsa_indexer_topk": npu_kernel(indexer_topk, indexer_topk_limits, lambda q, k, w, **kw: (q, k, w),
                                   "npu_lightning_indexer"),
    "dsa_sparse_prefill": _SPARSE_ATTENTION,
    "dsa_sparse_decode": _SPARSE_ATTENTION,
}
