"""AMD ``aiter`` operators behind the glm5-core contracts, used when the ``aiter`` package is installed.

* ``moe_route``: ``aiter.biased_grouped_topk(gating_output, correction_bias, topk_weights, topk_ids,
  num_expert_group, topk_group, need_renorm, routed_scaling_factor)`` fills the two outputs in place
  (sigmoid scores, bias for selection only). aiter does not promise our order or tie rule, so the
  result is put in selection order (biased score descending, lower id first) and every token whose
  selection touches a tie (equal biased scores at or around the k-th place, or equal group scores at
  the group cut) is recomputed by the Triton kernel, which implements the tie rule exactly.
* ``dsa_sparse_decode``: ``aiter.mla.mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
  kv_last_page_lens, max_seqlen_q, sm_scale)`` with a page size of 1: every query row is its own
  "sequence" whose pages are exactly its selected latent rows (the -1 entries dropped).

Argument building is plain torch (testable on CPU); only the two calls need aiter and a GPU.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch

from glm5_core.backends.triton import moe_route as triton_route
from glm5_core.backends.triton import sparse_mla as triton_sparse
from glm5_core.backends.triton.launch import LaunchConfig
from glm5_core.kernel import Kernel
from glm5_core.ops.mla import absorb_query, project_output

AITER_MLA_HEADS = (16, 128)  # head counts with native aiter MLA decode kernels (non-persistent mode)
AITER_EXPERT_GROUPS = (1, 2, 4, 8)  # num_expert_group values biased_grouped_topk instantiates (else AITER_CHECK)


# ---------------------------------------------------------------------------------------------- routing

def selection_order(weights, ids, select_scores) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder each token's K picks by (biased score descending, expert id ascending)."""
    picked = select_scores.gather(1, ids.long())  # [N, K]
    by_id = torch.sort(ids, dim=1, stable=True)  # ascending id first ...
    by_score = torch.sort(picked.gather(1, by_id.indices), dim=1, descending=True, stable=True)  # ... then score
    order = by_id.indices.gather(1, by_score.indices)
    return weights.gather(1, order), ids.gather(1, order)


def tie_rows(select_scores, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """bool [N]: tokens whose expert choice (or group choice) involves equal scores at the cut."""
    N, E = select_scores.shape
    edge = min(top_k + 1, E)
    top = torch.sort(select_scores, dim=1, descending=True).values[:, :edge]  # [N, K+1]
    ties = (top[:, 1:] == top[:, :-1]).any(1)
    if n_group > 1:
        grouped = select_scores.view(N, n_group, E // n_group)
        group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # [N, G]
        g_edge = min(topk_group + 1, n_group)
        g_top = torch.sort(group_score, dim=1, descending=True).values[:, :g_edge]
        ties |= (g_top[:, 1:] == g_top[:, :-1]).any(1)
    return ties


def route_with(biased_grouped_topk: Callable, logits, bias, *, top_k, score_func="sigmoid", n_group=1,
               topk_group=1, renormalize=True, routed_scaling_factor=1.0, config: LaunchConfig):
    """``moe_route`` through an aiter-style ``biased_grouped_topk``; tie rows rerun the Triton kernel."""
    N = logits.shape[0]
    weights = torch.empty((N, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((N, top_k), dtype=torch.int32, device=logits.device)
    # One dtype for both: aiter's register-resident and opt-sort kernels read correction_bias as the gating
    # dtype (csrc/kernels/topk_softmax_kernels_group.cu), so bf16 logits with an fp32 bias would be misread.
    # fp32 widening is exact, so the selection scores are those of the inputs.
    biased_grouped_topk(logits.float().contiguous(), bias.float().contiguous(), weights, ids, n_group, topk_group,
                        renormalize, float(routed_scaling_factor))
    select = torch.sigmoid(logits.float()) + bias.float()  # [N, E]
    weights, ids = selection_order(weights, ids, select)
    redo = tie_rows(select, top_k, n_group, topk_group).nonzero().flatten()
    if redo.numel():
        w_t, i_t = triton_route.route(logits[redo], bias, top_k=top_k, score_func=score_func, n_group=n_group,
                                      topk_group=topk_group, renormalize=renormalize,
                                      routed_scaling_factor=routed_scaling_factor, config=config)
        weights[redo], ids[redo] = w_t, i_t
    return weights, ids


def route_supports(logits, bias=None, *, score_func="sigmoid", n_group=1, renormalize=True, **kwargs):
    if bias is None or score_func != "sigmoid":
        return False, "aiter.biased_grouped_topk needs sigmoid scores and a bias"
    if n_group not in AITER_EXPERT_GROUPS:
        return False, f"aiter.biased_grouped_topk takes num_expert_group in {AITER_EXPERT_GROUPS}, got {n_group}"
    if not renormalize:
        # aiter/ops/topk.py: past cu_num * 212 tokens with E / n_group <= 32 it switches to moe_fused_gate
        # after `assert need_renorm`, so renormalize=False would fail on large batches.
        return False, "aiter.biased_grouped_topk asserts need_renorm on its large-batch path (moe_fused_gate)"
    return triton_route.supports(logits, bias, score_func=score_func, n_group=n_group, renormalize=renormalize,
                                 **kwargs)


# ---------------------------------------------------------------------------------------- sparse decode

@dataclasses.dataclass(frozen=True)
class MLADecodeArgs:
    """Arguments of ``aiter.mla.mla_decode_fwd`` for sparse decode (page size 1)."""

    q: torch.Tensor  # [R, H, C + Dr]
    kv_buffer: torch.Tensor  # [B * S, 1, 1, C + Dr]
    out: torch.Tensor  # [R, H, C]
    qo_indptr: torch.Tensor  # int32 [R + 1]
    kv_indptr: torch.Tensor  # int32 [R + 1]
    kv_indices: torch.Tensor  # int32 [total selected]
    kv_last_page_lens: torch.Tensor  # int32 [R] (all 1)
    empty_rows: torch.Tensor  # bool [R]: rows with no selected key (their output is zero)


def build_mla_decode_args(q_lat, q_pe, c_kv, k_pe, topk_idx) -> MLADecodeArgs:
    """Flatten (q_lat [B,T,H,C], q_pe [B,T,H,Dr], c_kv [B,S,C], k_pe [B,S,Dr], idx [B,T,K]) for aiter."""
    B, T, H, C = q_lat.shape
    S = c_kv.shape[1]
    R = B * T
    dtype = c_kv.dtype
    q = torch.cat([q_lat, q_pe], dim=-1).to(dtype).reshape(R, H, -1)  # [R, H, C+Dr]
    kv_buffer = torch.cat([c_kv, k_pe], dim=-1).reshape(B * S, 1, 1, -1)  # [B*S, 1, 1, C+Dr]
    idx = topk_idx.reshape(R, -1).long()  # [R, K]
    valid = idx >= 0
    row_base = (torch.arange(R, device=idx.device) // T * S).view(R, 1)  # b * S per row
    kv_indices = (idx + row_base)[valid].to(torch.int32)  # row-major: each row's keys in its order
    counts = valid.sum(1)  # [R]
    zero = torch.zeros(1, dtype=torch.int32, device=idx.device)
    kv_indptr = torch.cat([zero, torch.cumsum(counts, 0).to(torch.int32)])
    qo_indptr = torch.arange(R + 1, dtype=torch.int32, device=idx.device)
    out = torch.empty((R, H, C), dtype=dtype, device=q_lat.device)
    last = torch.ones(R, dtype=torch.int32, device=idx.device)
    return MLADecodeArgs(q, kv_buffer, out, qo_indptr, kv_indptr, kv_indices, last, counts == 0)


def sparse_decode_with(mla_decode_fwd: Callable, q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float,
                       config: LaunchConfig):
    B, T, H = q_nope.shape[:3]
    q_lat = absorb_query(q_nope.float(), w_uk.float())  # [B, T, H, C]
    args = build_mla_decode_args(q_lat, q_pe, c_kv, k_pe, topk_idx)
    mla_decode_fwd(args.q, args.kv_buffer, args.out, args.qo_indptr, args.kv_indptr, args.kv_indices,
                   args.kv_last_page_lens, 1, sm_scale=float(scale))
    o_lat = args.out.float().masked_fill(args.empty_rows.view(-1, 1, 1), 0.0)  # aiter leaves empty rows undefined
    return project_output(o_lat.view(B, T, H, -1), w_uv.float()).to(q_nope.dtype)


def sparse_decode_supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, **kwargs):
    if c_kv.dtype != torch.bfloat16:
        return False, f"aiter MLA decode takes bf16 caches, got {c_kv.dtype}"
    if q_nope.shape[2] not in AITER_MLA_HEADS:
        return False, f"aiter MLA decode has kernels for {AITER_MLA_HEADS} heads, got {q_nope.shape[2]}"
    return triton_sparse.supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, **kwargs)


# --------------------------------------------------------------------------------------------- binding

def aiter_kernels(configs) -> dict[str, Kernel]:
    """The ops aiter replaces. A call aiter cannot take (dtype, head count, no bias) goes to the Triton
    launcher inside the wrapper, not to the reference; ``supports`` is the Triton kernel's own."""
    aiter = importlib.import_module("aiter")
    mla = importlib.import_module("aiter.mla")
    route_config = configs.get(triton_route.FAMILY, triton_route.DEFAULT_LAUNCH)
    sparse_config = configs.get(triton_sparse.FAMILY, triton_sparse.DEFAULT_LAUNCH)

    def moe_route(logits, bias, **kwargs):
        if route_supports(logits, bias, **kwargs)[0]:
            return route_with(aiter.biased_grouped_topk, logits, bias, config=route_config, **kwargs)
        return triton_route.route(logits, bias, config=route_config, **kwargs)

    def dsa_sparse_decode(*args, **kwargs):
        if sparse_decode_supports(*args, **kwargs)[0]:
            return sparse_decode_with(mla.mla_decode_fwd, *args, config=sparse_config, **kwargs)
        return triton_sparse.sparse_decode(*args, config=sparse_config, **kwargs)

    moe_route.__module__ = dsa_sparse_decode.__module__ = __name__
    moe_route.__qualname__, dsa_sparse_decode.__qualname__ = "aiter.biased_grouped_topk", "aiter.mla.mla_decode_fwd"
    return {"moe_route": Kernel(moe_route, supports=triton_route.supports),
            "dsa_sparse_decode": Kernel(dsa_sparse_decode, supports=triton_sparse.supports)}
