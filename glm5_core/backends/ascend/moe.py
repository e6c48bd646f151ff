"""MoE on Ascend: routing (npu_moe_gating_top_k), dispatch (npu_moe_init_routing_v2), SwiGLU experts
(npu_grouped_matmul) and combine (npu_moe_finalize_routing). Layout work lives in ``moe_layouts``.

Legend: N tokens, E experts, K experts per token, M = N * K routed copies, D hidden, F expert FFN width.

Where our contract and the vendor ops differ:
  * route: the vendor documents no order among equal scores. It is asked for K + 1 candidates (when K < E);
    they are ordered by (biased score desc, expert id asc) from our own fp32 scores, and a token whose
    (K+1)-th candidate ties with its K-th is re-routed by the reference. Ids int32 as ours. The weights are
    recomputed from the gathered unbiased scores with the reference's formula (the vendor's yOut would be
    renormalised over K + 1 experts and is in the logits' dtype), which also serves renormalize=False.
  * dispatch: with row_idx_type 1 the vendor returns sorted row -> flat assignment, our sort_idx, as int32
    (widened to int64). Its sort is not documented stable: if the rows of one expert are not in
    token-then-slot order, the stable order is rebuilt and x is gathered again.
  * experts: our weights are [E, out, in]; the vendor multiplies by [E, in, out], given as transposed views.
    Counts become cumulative group_list. Gate and up outputs are rounded to the input dtype by the vendor
    (the reference keeps fp32 until the end): a tolerance-level difference for fp16/bf16.
  * combine: src_to_dst is column-major in drop_pad_mode 0; rows are widened to fp32 so the fp32 weights
    are used unrounded, as in the reference.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from glm5_core.backends.ascend import moe_layouts as L
from glm5_core.backends.ascend.vendor import Decision, dtype_in, first_output, npu_kernel, vendor_ops
from glm5_core.kernel import Kernel
from glm5_core.ops.moe import route_reference, swiglu

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GATING_MAX_EXPERTS = 2048
GATING_MIN_EXPERTS_PER_GROUP = 3  # "E / group_count > 2" (torch_npu-npu_moe_gating_top_k.md)
INIT_ROUTING_MAX_EXPERTS = 10240
GROUPED_MATMUL_MAX_GROUPS = 1024
GROUPED_MATMUL_INNER_LIMIT = 65536


# ------------------------------------------------------------------------------------------------ route
def route_limits(logits, bias, *, top_k: int, score_func: str = "sigmoid", n_group: int = 1,
                 topk_group: int = 1, renormalize: bool = True, routed_scaling_factor: float = 1.0) -> Decision:
    op = "npu_moe_gating_top_k"
    E = logits.shape[1]
    if score_func != "sigmoid":
        return False, f"{op} is mapped with norm_type=1 (sigmoid) only; softmax scoring runs the reference"
    if n_group != 1:
        return False, (f"{op} documents no tie order between expert groups, which the k+1 check cannot see; "
                       f"n_group={n_group} runs the reference (GLM-5 uses n_group=1)")
    if not GATING_MIN_EXPERTS_PER_GROUP <= E <= GATING_MAX_EXPERTS:
        return False, f"{op} takes {GATING_MIN_EXPERTS_PER_GROUP}..{GATING_MAX_EXPERTS} experts, got E={E}"
    return dtype_in("logits", logits, FLOAT_DTYPES, op)


def route(logits, bias, *, top_k: int, score_func: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
          renormalize: bool = True, routed_scaling_factor: float = 1.0, npu: Optional[object] = None):
    """Returns (weights fp32 [N, K], expert ids int32 [N, K]) under the routing contract."""
    ops = vendor_ops(npu)
    call = L.gating_call(logits, bias, top_k, routed_scaling_factor)
    candidates = ops.npu_moe_gating_top_k(call.x, call.k, **call.kwargs())[1]  # int32 [N, R]
    scores = L.sigmoid_scores(logits)  # [N, E]
    select = scores if bias is None else scores + bias.float()
    ids_sorted, values = L.canonical_experts(candidates, select)
    ids = ids_sorted[:, :top_k].clone()  # [N, K]
    tied = L.boundary_ties(values, top_k)  # [N]
    if bool(tied.any()):
        _, ref_ids = route_reference(logits[tied], bias, top_k=top_k, score_func=score_func, n_group=n_group,
                                     topk_group=topk_group, renormalize=renormalize,
                                     routed_scaling_factor=routed_scaling_factor)
        ids[tied] = ref_ids.to(ids.dtype)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + L.RENORM_EPS)
    return (weights * routed_scaling_factor).float(), ids.to(torch.int32)


# --------------------------------------------------------------------------------------------- dispatch
def dispatch_limits(x, expert_ids, *, num_experts: int) -> Decision:
    op = "npu_moe_init_routing_v2"
    if num_experts > INIT_ROUTING_MAX_EXPERTS:
        return False, f"{op} takes at most {INIT_ROUTING_MAX_EXPERTS} experts in count mode, got {num_experts}"
    if expert_ids.numel() == 0:
        return False, f"{op}: nothing to route (no tokens)"
    return dtype_in("x", x, FLOAT_DTYPES, op)


def dispatch(x, expert_ids, *, num_experts: int, npu: Optional[object] = None):
    """Returns (x_sorted [M, D], sort_idx int64 [M], counts int64 [E])."""
    ops = vendor_ops(npu)
    N, K = expert_ids.shape
    expanded_x, expanded_row_idx, counts = ops.npu_moe_init_routing_v2(
        x.contiguous(), expert_ids.to(torch.int32).contiguous(), **L.init_routing_kwargs(N, K, num_experts))[:3]
    sort_idx = L.sort_order(expanded_row_idx)  # [M]
    flat = expert_ids.reshape(-1).to(torch.int64)  # [M]
    if L.is_stable_expert_order(sort_idx, flat):
        return expanded_x, sort_idx, counts.to(torch.int64)
    sort_idx = torch.sort(flat, stable=True).indices  # restore the documented-by-us stable order
    return x[sort_idx // K], sort_idx, counts.to(torch.int64)


# ---------------------------------------------------------------------------------------------- experts
def experts_limits(x_sorted, counts, w_gate, w_up, w_down, **kwargs) -> Decision:
    op = "npu_grouped_matmul"
    E, Fdim, D = w_gate.shape
    if E > GROUPED_MATMUL_MAX_GROUPS:
        return False, f"{op} takes at most {GROUPED_MATMUL_MAX_GROUPS} groups, got E={E}"
    if max(D, Fdim) >= GROUPED_MATMUL_INNER_LIMIT:
        return False, f"{op} needs inner dims below {GROUPED_MATMUL_INNER_LIMIT}, got D={D}, F={Fdim}"
    if x_sorted.shape[0] == 0:
        return False, f"{op}: no rows"
    return dtype_in("x_sorted", x_sorted, FLOAT_DTYPES, op)


def _grouped(ops, x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """One x [M, in], one weight [E, in, out], rows grouped by expert: the single-tensor (split_item 3) form."""
    return first_output(ops.npu_grouped_matmul([x], [weight], group_list=group_list, split_item=3,
                                               group_type=0, group_list_type=0))


def experts(x_sorted, counts, w_gate, w_up, w_down, *, swiglu_limit: Optional[float] = None,
            npu: Optional[object] = None) -> torch.Tensor:
    """SwiGLU experts over expert-sorted rows. Returns [M, D] in the input dtype. The activation runs in torch
    between the grouped matmuls, so GLM-5.3's clamped SwiGLU (``swiglu_limit``) is the same torch clamp as the
    reference's."""
    ops = vendor_ops(npu)
    groups = L.cumulative_groups(counts)
    x = x_sorted.contiguous()
    gate = _grouped(ops, x, L.as_matmul_weight(w_gate), groups)  # [M, F]
    up = _grouped(ops, x, L.as_matmul_weight(w_up), groups)  # [M, F]
    hidden = swiglu(gate.float(), up.float(), swiglu_limit).to(x.dtype)  # [M, F]
    return _grouped(ops, hidden, L.as_matmul_weight(w_down), groups)  # [M, D]


# ---------------------------------------------------------------------------------------------- combine
def combine_limits(y_sorted, sort_idx, weights) -> Decision:
    return dtype_in("y_sorted", y_sorted, FLOAT_DTYPES, "npu_moe_finalize_routing")


def combine(y_sorted, sort_idx, weights, *, npu: Optional[object] = None) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * y[row of (n, j)]. Returns [N, D] in y's dtype."""
    ops = vendor_ops(npu)
    call = L.finalize_call(y_sorted, sort_idx, weights)
    out = ops.npu_moe_finalize_routing(*call.args(), drop_pad_mode=L.COLUMN_MAJOR_DROPLESS)  # fp32 [N, D]
    return out.to(y_sorted.dtype)


KERNELS: Mapping[str, Kernel] = {
    "moe_route": npu_kernel(route, route_limits, lambda logits, bias, **kw: (logits, bias), "npu_moe_gating_top_k"),
    "moe_dispatch": npu_kernel(dispatch, dispatch_limits, lambda x, expert_ids, **kw: (x,), "npu_moe_init_routing_v2"),
    "moe_experts": npu_kernel(experts, experts_limits, lambda x_sorted, counts, w_gate, w_up, w_down, **kw: (
        x_sorted, counts, w_gate, w_up, w_down), "npu_grouped_matmul"),
    "moe_combine": npu_kernel(combine, combine_limits,
                              lambda y_sorted, sort_idx, weights, **kw: (y_sorted, sort_idx, weights),
                              "npu_moe_finalize_routing"),
}
