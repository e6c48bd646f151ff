"""Argument building and result conversion for the MoE vendor ops (pure torch; tested on CPU).

Legend: N tokens, E experts, K experts per token, R candidates asked of the gating op (K + 1 where
possible), M = N * K routed copies, D hidden, F expert FFN width; a "flat" assignment index is n * K + j.

Vendor contracts used (``op-plugin/docs/context/torch_npu-npu_moe_*.md`` and ``torch_npu-npu_grouped_matmul.md``;
formulas in CANN ops-transformer ``moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md`` and
``moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md``):
  * npu_moe_gating_top_k: norm_type 1 = sigmoid, bias added for selection only, group_count 1 = no group
    stage, expert ids int32 [N, k]; with sigmoid the weights are always renormalised (renorm is ignored);
    x and bias share one dtype (fp16/bf16/fp32), E <= 2048. No order among equal scores is documented.
  * npu_moe_init_routing_v2: flattens expert_idx row-major (flat i -> token i // K), key-value sorts it by
    expert, expanded_x[i] = x[sortedRowIdx[i] // K]; with row_idx_type 1 (the "scatter" index type)
    expanded_row_idx IS sortedRowIdx (sorted row -> flat assignment, our gather form), with 0 it is the
    inverse (expanded_row_idx[sortedRowIdx[i]] = i). torch_npu calls aclnnMoeInitRoutingV3, whose kernels
    (moe_v3_sort_one_core.h, moe_v3_row_idx_gather.h, moe_v3_gather_out.h) write it this way. Per-expert
    counts (expert_tokens_num_type 1) as int64. Stability of the sort is not documented.
  * npu_grouped_matmul: y_i = x_i @ weight_i, weight [E, in, out] (a transposed view is accepted),
    group_type 0 groups the rows of one x, group_list int64 cumulative row counts (group_list_type 0).
  * npu_moe_finalize_routing: out[i] = sum_k scales[i, k] * rows[src_to_dst[i + k * N]] in drop_pad_mode 0
    (column-major src_to_dst, int32); rows and scales share one dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from glm5_core.ops.moe import _sigmoid as moe_reference_sigmoid

RENORM_EPS = 1e-20  # the reference's renormalisation epsilon, also the vendor's default eps
SIGMOID = 1
ONE_GROUP = 1
TOP2_SUM_GROUPS = 1
COUNT_MODE = 1
SCATTER_ROW_INDEX = 1
NO_QUANT = -1
DROPLESS = 0
COLUMN_MAJOR_DROPLESS = 0


# --------------------------------------------------------------------------------------------- route
def sigmoid_scores(logits: torch.Tensor) -> torch.Tensor:
    """fp32 [N, E] scores with the reference's formula 1 / (1 + exp(-x)) (batch-shape independent), and its
    backward s * (1 - s), finite where exp(-x) overflows."""
    return moe_reference_sigmoid(logits.float())


@dataclasses.dataclass(frozen=True)
class GatingCall:
    x: torch.Tensor  # fp32 [N, E]: bf16/fp16 logits widen exactly, and bias (fp32) must share x's dtype
    k: int
    bias: Optional[torch.Tensor]  # fp32 [E]
    routed_scaling_factor: float

    def kwargs(self) -> dict[str, object]:
        return dict(bias=self.bias, k_group=1, group_count=ONE_GROUP, group_select_mode=TOP2_SUM_GROUPS,
                    renorm=0, norm_type=SIGMOID, out_flag=False,
                    routed_scaling_factor=self.routed_scaling_factor, eps=RENORM_EPS)


def gating_call(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
                routed_scaling_factor: float) -> GatingCall:
    E = logits.shape[1]
    return GatingCall(x=logits.float().contiguous(), k=top_k + 1 if top_k < E else top_k,
                      bias=None if bias is None else bias.float().contiguous(),
                      routed_scaling_factor=float(routed_scaling_factor))


def canonical_experts(ids: torch.Tensor, select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates [N, R] ordered by selection score desc, ties to the LOWER expert id.
    Returns (ids int64 [N, R], their selection scores [N, R])."""
    ids = torch.sort(ids.to(torch.int64), dim=-1).values  # by id first
    values = select.gather(1, ids)
    by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices  # equal values keep id order
    return ids.gather(1, by_value), values.gather(1, by_value)


def boundary_ties(values_sorted: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool [N]: the (K+1)-th candidate ties with the K-th, so a lower-id expert may have been left out."""
    if values_sorted.shape[1] <= top_k:
        return torch.zeros(values_sorted.shape[0], dtype=torch.bool, device=values_sorted.device)
    return values_sorted[:, top_k] == values_sorted[:, top_k - 1]


def route_weights(scores: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float) -> torch.Tensor:
    """The reference's weights: unbiased scores of the chosen experts, renormalised, scaled. fp32 [N, K]."""
    w = scores.gather(1, ids)
    return w / (w.sum(-1, keepdim=True) + RENORM_EPS) * routed_scaling_factor


# ------------------------------------------------------------------------------------------ dispatch
def init_routing_kwargs(num_rows: int, top_k: int, num_experts: int) -> dict[str, object]:
    return dict(active_num=num_rows * top_k, expert_capacity=0, expert_num=num_experts,
                drop_pad_mode=DROPLESS, expert_tokens_num_type=COUNT_MODE, expert_tokens_num_flag=True,
                quant_mode=NO_QUANT, active_expert_range=[0, num_experts], row_idx_type=SCATTER_ROW_INDEX)


def sort_order(expanded_row_idx: torch.Tensor) -> torch.Tensor:
    """row_idx_type 1 output (sorted row -> flat assignment, int32) as our sort_idx (int64): no inversion."""
    return expanded_row_idx.to(torch.int64)


def is_stable_expert_order(sort_idx: torch.Tensor, flat_ids: torch.Tensor) -> bool:
    """True when rows are grouped by ascending expert and, inside an expert, by ascending flat index
    (our dispatch contract: token order, then slot order)."""
    experts = flat_ids[sort_idx]  # [M]
    if experts.numel() < 2:
        return True
    rising = experts[1:] > experts[:-1]
    same = experts[1:] == experts[:-1]
    return bool((rising | (same & (sort_idx[1:] > sort_idx[:-1]))).all())


# ----------------------------------------------------------------------------------- grouped matmul
def cumulative_groups(counts: torch.Tensor) -> torch.Tensor:
    """group_list_type 0: cumulative row counts, int64 [E]."""
    return torch.cumsum(counts.to(torch.int64), dim=0)


def as_matmul_weight(w: torch.Tensor) -> torch.Tensor:
    """Our weights are [E, out, in] (nn.Linear rows); the vendor multiplies x @ weight_e with weight [E, in, out].
    A transposed view, no copy: the op documents transposed weights as supported."""
    return w.transpose(1, 2)


# ------------------------------------------------------------------------------------------- combine
def column_major_src_to_dst(sort_idx: torch.Tensor, num_rows: int, top_k: int) -> torch.Tensor:
    """drop_pad_mode 0 indexes src_to_dst at i + k * N; ours is flat n * K + j. int32 [N * K]."""
    inverse = torch.empty_like(sort_idx)
    inverse[sort_idx] = torch.arange(sort_idx.numel(), device=sort_idx.device)  # flat -> sorted row
    return inverse.view(num_rows, top_k).t().reshape(-1).to(torch.int32).contiguous()


@dataclasses.dataclass(frozen=True)
class FinalizeCall:
    rows: torch.Tensor  # fp32 [M, D]: widened exactly so the fp32 weights need no rounding
    scales: torch.Tensor  # fp32 [N, K]
    src_to_dst: torch.Tensor  # int32 [M], column-major

    def args(self):
        return (self.rows, None, None, None, self.scales, self.src_to_dst, None)


def finalize_call(y_sorted: torch.Tensor, sort_idx: torch.Tensor, weights: torch.Tensor) -> FinalizeCall:
    N, K = weights.shape
    return FinalizeCall(rows=y_sorted.float().contiguous(), scales=weights.float().contiguous(),
                        src_to_dst=column_major_src_to_dst(sort_idx.to(torch.int64), N, K))
