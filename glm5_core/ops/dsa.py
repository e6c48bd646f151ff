"""DeepSeek Sparse Attention: the lightning indexer, its deterministic top-k, and sparse MLA attention.

The ops of this family (``OPS`` at the end declares them), each ``dsa_<name>`` with entry point ``<name>``:

  dsa_indexer_scores             indexer_scores             indexer_scores_reference
  dsa_indexer_topk               indexer_topk               indexer_topk_reference
  dsa_kpool_topk                 kpool_topk                 ``ops/kpool_topk.py``'s reference  (GLM-5.3's k-pool)
  dsa_sparse_prefill             sparse_prefill             sparse_attention_reference   (absorbed, latent keys)
  dsa_sparse_decode              sparse_decode              sparse_attention_reference
  dsa_sparse_prefill_expanded    sparse_prefill_expanded    sparse_prefill_expanded_reference  (per-head keys)
  dsa_selected_index_scores      selected_index_scores      ``ops/selected_index_scores.py``'s reference
  dsa_selected_attention_target  selected_attention_target  ``ops/selected_attention_target.py``'s reference

Legend (sizes):
  B batch, T queries, S key slots, H indexer heads, D index_head_dim, K top-k width,
  MLA sizes as in ``glm5_core.ops.mla`` (Dn, Dr, Dv, C; ``Hm`` attention heads).

Indexer score:  I[b,t,s] = sum_h w[b,t,h] * ReLU(q[b,t,h,:] . k[b,s,:]), accumulated in fp32,
                causal (key s visible to the query at absolute position p iff s <= p).

Top-k contract (every backend):
  * int32 indices [B, T, K], sorted by score descending, ties broken by the LOWER key index;
  * row with ``n = min(K, p + 1)`` visible keys holds ``n`` indices, then ``-1`` padding;
  * bitwise identical across runs, across batch sizes / chunkings, and between prefill (all queries
    at once) and decode (one query against a cache): the rollout engine and the trainer select the
    same keys ("RL-stable").

How the reference keeps that promise on CPU BLAS: the q.k dot products go through one GEMM whose row
count is padded to a multiple of ``_gemm.GEMM_ROW_BLOCK`` and whose key count to a multiple of ``GEMM_KEY_BLOCK``
(BLAS libraries switch to GEMV or small-matrix kernels, with another summation order, for few rows or few
keys: a 4-slot prefill and a 40-slot decode cache used to round the same q.k differently, and near-tied keys
swapped), and the head sum is an explicit loop in head order, so every score is computed by the same
sequence of roundings whatever the batch shape and cache length. ``glm5_core.conformance.determinism`` checks it.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from glm5_core import registry
from glm5_core.ops import _checks
from glm5_core.ops._gemm import rows_dot_keys as _rows_dot_keys
from glm5_core.ops.kpool_topk import kpool_topk_reference as kpool_topk_reference
from glm5_core.ops.mla import absorb_query, causal_mask, project_output, validate_mla_tensors
from glm5_core.ops.selected_attention_target import NORMALISERS, selected_attention_target_reference
from glm5_core.ops.selected_index_scores import selected_index_scores_reference
from glm5_core.opspec import OpSpec

StartPos = Union[int, torch.Tensor]

_SPARSE_QUERY_CHUNK = 64  # bounds the reference's gathered [chunk, K, C] working set


def _validate_indexer(q, k, w, start_pos) -> dict[str, int]:
    sizes: dict[str, int] = {}
    _checks.tensor("q", q, dims=("B", "T", "H", "D"), sizes=sizes, legend="[B, T, H, D]")
    _checks.tensor("k", k, dims=("B", "S", "D"), sizes=sizes, legend="[B, S, D]")
    _checks.tensor("w", w, dims=("B", "T", "H"), sizes=sizes, legend="[B, T, H]")
    _checks.same_dtype(q=q, k=k)
    device = _checks.same_device(q=q, k=k, w=w)
    if sizes["S"] < 1 or sizes["T"] < 1:
        raise ValueError(f"q / k: expected at least one query and one key, got T={sizes['T']}, S={sizes['S']}")
    if sizes["H"] < 1:  # no head: every score would be the empty sum, and the backends would disagree on it
        raise ValueError(f"q / w: expected at least one indexer head (H >= 1), got H={sizes['H']}")
    _checks.start_positions(start_pos, sizes["B"], sizes["T"], sizes["S"], device)
    _checks.finite("q", q)
    _checks.finite("k", k)
    _checks.finite("w", w)
    return sizes


def indexer_scores_reference(q, k, w, *, start_pos: StartPos = 0) -> torch.Tensor:
    """I[b,t,s] as fp32 (fp64 for fp64 inputs) [B, T, S]; keys not visible to a query are -inf."""
    ct = _checks.compute_dtype(q.dtype)
    B, T, H, D = q.shape
    S = k.shape[1]
    dots = _rows_dot_keys(q.to(ct).reshape(B, T * H, D), k.to(ct)).view(B, T, H, S)  # [B, T, H, S]
    # per-head views by one unbind (its backward stacks the head gradients once; a select per head would
    # allocate and zero a [B, T, H, S] gradient for each head)
    heads, head_w = torch.relu(dots).unbind(2), w.to(ct).unbind(2)  # H x [B, T, S], H x [B, T]
    scores = head_w[0].unsqueeze(-1) * heads[0]  # [B, T, S]
    for h in range(1, H):  # fixed head order: one rounding sequence per score
        scores = scores + head_w[h].unsqueeze(-1) * heads[h]
    visible = causal_mask(start_pos, B, T, S, q.device)  # [B, T, S]
    return scores.masked_fill(~visible, float("-inf"))


def _topk_from_scores(scores: torch.Tensor, topk: int, start_pos: StartPos) -> torch.Tensor:
    """Apply the top-k contract to masked scores [B, T, S] -> int32 [B, T, topk]."""
    B, T, S = scores.shape
    if _checks.value_checks_enabled() and bool(torch.isnan(scores).any()):  # a value: none under FakeTensorMode
        raise ValueError("q, k, w: indexer scores overflowed to NaN; rescale the inputs")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]  # [B, T, <=topk]
    if order.shape[-1] < topk:  # fewer key slots than k
        order = torch.cat([order, order.new_full((B, T, topk - order.shape[-1]), -1)], dim=-1)
    pos = _checks.query_positions(start_pos, B, T, scores.device)  # [B, T]
    n_valid = torch.clamp(pos + 1, max=min(topk, S))  # [B, T]
    rank = torch.arange(topk, device=scores.device)  # [topk]
    order = torch.where(rank < n_valid.unsqueeze(-1), order, torch.full_like(order, -1))
    return order.to(torch.int32)


def indexer_topk_reference(q, k, w, *, topk: int, start_pos: StartPos = 0) -> torch.Tensor:
    """The top-k contract applied to the reference scores: int32 [B, T, topk]."""
    return _topk_from_scores(indexer_scores_reference(q, k, w, start_pos=start_pos), topk, start_pos)


def sparse_attention_reference(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float):
    """Absorbed MLA restricted to the selected latent rows. Returns [B, T, Hm, Dv] in the input dtype.

    Entries of ``topk_idx`` equal to -1 are skipped; a query with no selected key yields zeros."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (t.to(ct) for t in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    B, T = q_nope.shape[:2]
    q_lat = absorb_query(q_nope, w_uk)  # [B, T, Hm, C]
    batch = torch.arange(B, device=q_nope.device).view(B, 1, 1)  # [B, 1, 1]
    chunks = []
    for t0 in range(0, T, _SPARSE_QUERY_CHUNK):
        idx = topk_idx[:, t0:t0 + _SPARSE_QUERY_CHUNK].long()  # [B, t, K]
        valid = idx >= 0
        rows = idx.clamp(min=0)
        kv = c_kv[batch, rows]  # [B, t, K, C]
        kr = k_pe[batch, rows]  # [B, t, K, Dr]
        scores = torch.einsum("bthc,btkc->bthk", q_lat[:, t0:t0 + _SPARSE_QUERY_CHUNK], kv)
        scores = scores + torch.einsum("bthr,btkr->bthk", q_pe[:, t0:t0 + _SPARSE_QUERY_CHUNK], kr)
        scores = (scores * scale).masked_fill(~valid.unsqueeze(2), float("-inf"))  # [B, t, Hm, K]
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(valid.any(-1)[:, :, None, None], probs, torch.zeros_like(probs))  # no key: zeros
        chunks.append(torch.einsum("bthk,btkc->bthc", probs, kv))  # [B, t, Hm, C]
    o_lat = torch.cat(chunks, dim=1)  # [B, T, Hm, C]
    return project_output(o_lat, w_uv).to(out_dtype)


def sparse_prefill_expanded_reference(q_nope, q_pe, k_nope, k_pe, v, topk_idx, *, scale: float) -> torch.Tensor:
    """MLA's expanded form restricted to the selected keys. Returns [B, T, Hm, Dv] in the input dtype.

    Per-head keys k_nope [B, S, Hm, Dn] and values v [B, S, Hm, Dv] (kv_b_proj applied to the latent rows), the
    rope key k_pe [B, S, Dr] shared by the heads. The same function as ``sparse_attention_reference`` of the
    latent rows they expand; entries of ``topk_idx`` equal to -1 are skipped, a query with no key yields zeros."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_nope, q_pe, k_nope, k_pe, v = (t.to(ct) for t in (q_nope, q_pe, k_nope, k_pe, v))
    B, T = q_nope.shape[:2]
    batch = torch.arange(B, device=q_nope.device).view(B, 1, 1)  # [B, 1, 1]
    chunks = []
    for t0 in range(0, T, _SPARSE_QUERY_CHUNK):
        idx = topk_idx[:, t0:t0 + _SPARSE_QUERY_CHUNK].long()  # [B, t, K]
        valid = idx >= 0
        rows = idx.clamp(min=0)
        kn, kr, vv = k_nope[batch, rows], k_pe[batch, rows], v[batch, rows]  # [B, t, K, Hm, Dn], [B, t, K, Dr], ..Dv]
        scores = torch.einsum("bthd,btkhd->bthk", q_nope[:, t0:t0 + _SPARSE_QUERY_CHUNK], kn)
        scores = scores + torch.einsum("bthr,btkr->bthk", q_pe[:, t0:t0 + _SPARSE_QUERY_CHUNK], kr)
        scores = (scores * scale).masked_fill(~valid.unsqueeze(2), float("-inf"))  # [B, t, Hm, K]
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(valid.any(-1)[:, :, None, None], probs, torch.zeros_like(probs))  # no key: zeros
        chunks.append(torch.einsum("bthk,btkhv->bthv", probs, vv))  # [B, t, Hm, Dv]
    return torch.cat(chunks, dim=1).to(out_dtype)


OPS = (
    OpSpec("dsa_indexer_scores", indexer_scores_reference, family="dsa", differentiable=True),
    OpSpec("dsa_indexer_topk", indexer_topk_reference, family="dsa", gradient_free=True),  # int32 indices
    OpSpec("dsa_kpool_topk", kpool_topk_reference, family="dsa", gradient_free=True),  # int32 indices
    OpSpec("dsa_sparse_prefill", sparse_attention_reference, family="dsa", differentiable=True),
    OpSpec("dsa_sparse_decode", sparse_attention_reference, family="dsa"),
    OpSpec("dsa_selected_index_scores", selected_index_scores_reference, family="dsa", differentiable=True),
    OpSpec("dsa_sparse_prefill_expanded", sparse_prefill_expanded_reference, family="dsa", differentiable=True),
    # the sparse stage's indexer-KL target: detached, so a kernel takes calls whose inputs require grad
    OpSpec("dsa_selected_attention_target", selected_attention_target_reference, family="dsa", gradient_free=True),
)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, start_pos: StartPos = 0,
                   backend: registry.BackendArg = None) -> torch.Tensor:
    """Lightning-indexer scores [B, T, S] (fp32; fp64 for fp64 inputs), -inf where not causal."""
    _validate_indexer(q, k, w, start_pos)
    return registry.call("dsa_indexer_scores", q, k, w, start_pos=start_pos, backend=backend)


def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, *, start_pos: StartPos = 0,
                 backend: registry.BackendArg = None) -> torch.Tensor:
    """Deterministic top-k of the indexer scores: int32 [B, T, topk] (see the module contract)."""
    sizes = _validate_indexer(q, k, w, start_pos)
    _checks.topk_width("topk", topk, batch=sizes["B"], queries=sizes["T"], keys=sizes["S"], device=q.device)
    return registry.call("dsa_indexer_topk", q, k, w, topk=topk, start_pos=start_pos, backend=backend)


def kpool_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, *,
               topk: int, kpool: int, select_tail: bool = True, scale: Optional[float] = None,
               start_pos: StartPos = 0, backend: registry.BackendArg = None) -> torch.Tensor:
    """GLM-5.3's k-pool indexer top-k (``glm5_core.ops.kpool_topk`` states the contract): the ``topk // kpool`` best
    complete pools of ``kpool`` keys, expanded to their token indices, then (``select_tail``) the query's
    incomplete tail group. q [B, T, H, D], k [B, S, D] (the indexer keys), w [B, T, H] (head weights, already
    times H^-0.5 as transformers' ``weights_proj``), gate [B, S, D] (the keys' compress-gate projection), ape
    [kpool, D]; ``scale`` defaults to D^-0.5 (transformers' ``softmax_scale``). Returns int32 [B, T, topk (+
    kpool - 1 with the tail)], -1 padded."""
    sizes = _validate_indexer(q, k, w, start_pos)
    _checks.tensor("gate", gate, dims=("B", "S", "D"), sizes=sizes, legend="[B, S, D]")
    _checks.positive_int("kpool", kpool)
    _checks.tensor("ape", ape, dims=(kpool, "D"), sizes=sizes, legend="[kpool, D]")
    _checks.same_device(q=q, gate=gate, ape=ape)
    _checks.finite("gate", gate)
    _checks.finite("ape", ape)
    _checks.topk_width("topk", topk, batch=sizes["B"], queries=sizes["T"], keys=sizes["S"], device=q.device)
    if topk % kpool:
        raise ValueError(f"topk: expected a multiple of kpool={kpool} (transformers' index_topk % index_kpool == 0), "
                         f"got {topk}")
    if not isinstance(select_tail, bool):
        raise TypeError(f"select_tail: expected a bool, got {type(select_tail).__name__}")
    scale = sizes["D"] ** -0.5 if scale is None else _checks.positive_float("scale", scale)
    return registry.call("dsa_kpool_topk", q, k, w, gate, ape, topk=topk, kpool=kpool, select_tail=select_tail,
                         scale=float(scale), start_pos=start_pos, backend=backend)


def selected_index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk_idx: torch.Tensor, *,
                          backend: registry.BackendArg = None) -> torch.Tensor:
    """The indexer scores at the selected keys only (the sparse stage's indexer KL): [B, T, K] in the compute
    dtype (fp32, fp64 for fp64 inputs), -inf at the -1 slots of ``topk_idx`` [B, T, K]; differentiable in q, k
    and w, in O(T K) memory (never [B, T, S])."""
    sizes: dict[str, int] = {}
    _checks.tensor("q", q, dims=("B", "T", "H", "D"), sizes=sizes, legend="[B, T, H, D]")
    _checks.tensor("k", k, dims=("B", "S", "D"), sizes=sizes, legend="[B, S, D]")
    _checks.tensor("w", w, dims=("B", "T", "H"), sizes=sizes, legend="[B, T, H]")
    _checks.tensor("topk_idx", topk_idx, dims=("B", "T", None), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                   legend="[B, T, K] int32")
    _checks.same_dtype(q=q, k=k)
    _checks.same_device(q=q, k=k, w=w, topk_idx=topk_idx)
    if sizes["S"] < 1 or sizes["H"] < 1:
        raise ValueError(f"k / q: expected at least one key and one indexer head, got S={sizes['S']}, "
                         f"H={sizes['H']}")
    _checks.index_range("topk_idx", topk_idx, -1, sizes["S"] - 1)  # -1 = no key
    return registry.call("dsa_selected_index_scores", q, k, w, topk_idx, backend=backend)


def selected_attention_target(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                              w_uk: torch.Tensor, topk_idx: torch.Tensor, *, scale: float, start_pos: StartPos,
                              k_nope: Optional[torch.Tensor] = None, normaliser: str = "selected",
                              backend: registry.BackendArg = None) -> torch.Tensor:
    """The sparse stage's indexer-KL target at the selected keys topk_idx [B, T, K] (-1 = none): the main
    attention's probabilities (scale * (q_nope . k_nope + q_pe . k_pe) per head) summed over the Hm heads and
    divided by Hm. ``normaliser`` says which keys each head's softmax runs over:
      "selected" (default): the row's valid selected keys only, the sparse attention's own probabilities, as
        Megatron-LM's DSA indexer loss with ``sparse_loss=True`` (experimental_attention_variant/dsa.py);
        each row sums to 1 (0 for a row with no valid key); O(T K Hm D).
      "causal": EVERY causal key (the dense attention gathered at the selected keys; its row sums are the top-k
        recall); the normaliser needs a pass over all T x S scores.
    Returns [B, T, K] in the compute dtype (fp32, fp64 for fp64 inputs), 0 at the -1 slots and at keys past the
    query. The indices of a row are distinct (the indexer's top-k). Detached: no gradient flows to any input,
    whatever they require. ``k_nope`` [B, S, Hm, Dn]: the expanded keys c_kv W_UK^T when the caller has them (else
    computed here). Memory O(T K) plus O(S Hm Dn): never a [B, T, S] tensor."""
    if normaliser not in NORMALISERS:
        raise ValueError(f"normaliser: expected one of {', '.join(repr(n) for n in NORMALISERS)}, "
                         f"got {normaliser!r}")
    sizes = validate_mla_tensors(q_nope, q_pe, c_kv, k_pe, w_uk, None, scale)  # w_uv None: no values here
    _checks.tensor("topk_idx", topk_idx, dims=("B", "T", None), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                   legend="[B, T, K] int32")
    if k_nope is not None:
        _checks.tensor("k_nope", k_nope, dims=("B", "S", "H", "Dn"), sizes=sizes, legend="[B, S, H, Dn]")
    device = _checks.same_device(q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w_uk=w_uk, topk_idx=topk_idx,
                                 k_nope=k_nope)
    if sizes["S"] < 1 or sizes["T"] < 1 or sizes["H"] < 1:
        raise ValueError(f"c_kv / q_nope: expected at least one key, one query and one head, got S={sizes['S']}, "
                         f"T={sizes['T']}, H={sizes['H']}")
    _checks.start_positions(start_pos, sizes["B"], sizes["T"], sizes["S"], device)
    _checks.index_range("topk_idx", topk_idx, -1, sizes["S"] - 1)  # -1 = no key
    return registry.call("dsa_selected_attention_target", q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx,
                         scale=float(scale), start_pos=start_pos, k_nope=k_nope, normaliser=normaliser,
                         backend=backend)


def _validate_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, scale) -> None:
    sizes = validate_mla_tensors(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale)
    _checks.tensor("topk_idx", topk_idx, dims=("B", "T", None), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                   legend="[B, T, K] int32")
    _checks.same_device(q_nope=q_nope, topk_idx=topk_idx)
    if sizes["S"] < 1 or sizes["T"] < 1:
        raise ValueError(f"c_kv / q_nope: expected at least one key and one query, got S={sizes['S']}, T={sizes['T']}")
    _checks.index_range("topk_idx", topk_idx, -1, sizes["S"] - 1)  # -1 = no key


def sparse_prefill(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float,
                   backend: registry.BackendArg = None) -> torch.Tensor:
    """Sparse MLA for many queries (training / prefill; differentiable). Returns [B, T, Hm, Dv]."""
    _validate_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, scale)
    return registry.call("dsa_sparse_prefill", q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx,
                         scale=float(scale), backend=backend)


def sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float,
                  backend: registry.BackendArg = None) -> torch.Tensor:
    """Sparse MLA for few queries against a latent cache (inference). Returns [B, T, Hm, Dv]."""
    _validate_sparse(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, scale)
    return registry.call("dsa_sparse_decode", q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx,
                         scale=float(scale), backend=backend)


EXPANDED_READ_RATIO = 4  # most values read per selected key by the expanded form, relative to the absorbed form


def prefers_expanded(*, heads: int, nope_dim: int, rope_dim: int, v_dim: int, kv_rank: int, queries: int, keys: int,
                     topk: int) -> bool:
    """Whether ``sparse_prefill_expanded`` costs less than the absorbed ``sparse_prefill`` for these sizes.

    Arithmetic, multiply-adds per layer over H: expanded keys * (Dn + Dv) * C (kv_b_proj over the latent rows)
    + queries * topk * (Dn + Dr + Dv); absorbed queries * (Dn + Dv) * C (absorb q, project out) + queries * topk *
    (2 C + Dr). Memory: per (query, selected key) the expanded form reads H (Dn + Dv) + Dr values, the absorbed
    C + Dr (shared by the heads); past ``EXPANDED_READ_RATIO`` times as many, a per-query kernel is bound by those
    reads (cpu, measured: 3.7x at the training benchmark's sizes ran 2.2x faster, 6.3x at bench_kernelize's,
    top-k 2048, 0.53x as fast)."""
    Dn, Dr, Dv, C = nope_dim, rope_dim, v_dim, kv_rank
    expanded = keys * (Dn + Dv) * C + queries * topk * (Dn + Dr + Dv)
    absorbed = queries * (Dn + Dv) * C + queries * topk * (2 * C + Dr)
    return expanded < absorbed and heads * (Dn + Dv) + Dr <= EXPANDED_READ_RATIO * (C + Dr)


def _validate_sparse_expanded(q_nope, q_pe, k_nope, k_pe, v, topk_idx, scale) -> None:
    sizes: dict[str, int] = {}
    _checks.tensor("q_nope", q_nope, dims=("B", "T", "H", "Dn"), sizes=sizes, legend="[B, T, H, Dn]")
    _checks.tensor("q_pe", q_pe, dims=("B", "T", "H", "Dr"), sizes=sizes, legend="[B, T, H, Dr]")
    _checks.tensor("k_nope", k_nope, dims=("B", "S", "H", "Dn"), sizes=sizes, legend="[B, S, H, Dn]")
    _checks.tensor("k_pe", k_pe, dims=("B", "S", "Dr"), sizes=sizes, legend="[B, S, Dr]")
    _checks.tensor("v", v, dims=("B", "S", "H", None), sizes=sizes, legend="[B, S, H, Dv]")
    _checks.tensor("topk_idx", topk_idx, dims=("B", "T", None), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                   legend="[B, T, K] int32")
    _checks.same_dtype(q_nope=q_nope, q_pe=q_pe, k_nope=k_nope, k_pe=k_pe, v=v)
    _checks.same_device(q_nope=q_nope, q_pe=q_pe, k_nope=k_nope, k_pe=k_pe, v=v, topk_idx=topk_idx)
    _checks.positive_float("scale", scale)
    if sizes["S"] < 1 or sizes["T"] < 1 or sizes["H"] < 1:
        raise ValueError(f"k_nope / q_nope: expected at least one key, one query and one head, got S={sizes['S']}, "
                         f"T={sizes['T']}, H={sizes['H']}")
    _checks.index_range("topk_idx", topk_idx, -1, sizes["S"] - 1)  # -1 = no key


def sparse_prefill_expanded(q_nope, q_pe, k_nope, k_pe, v, topk_idx, *, scale: float,
                            backend: registry.BackendArg = None) -> torch.Tensor:
    """Sparse MLA for many queries in the expanded form (training / prefill; differentiable): per-head keys
    k_nope [B, S, Hm, Dn], the shared rope key k_pe [B, S, Dr], values v [B, S, Hm, Dv]. Returns [B, T, Hm, Dv].

    Dn + Dr products per score and Dv per output, against C + Dr and C for ``sparse_prefill``'s absorbed form,
    at the price of expanding the keys (kv_b_proj over the S latent rows, once per layer)."""
    _validate_sparse_expanded(q_nope, q_pe, k_nope, k_pe, v, topk_idx, scale)
    return registry.call("dsa_sparse_prefill_expanded", q_nope, q_pe, k_nope, k_pe, v, topk_idx,
                         scale=float(scale), backend=backend)
