"""cpu backend kernels for MoE: routing selection, dispatch and combine.

``route`` runs the whole routing contract natively, row by row in scalar code, so a token's ids and
weights are bitwise the same whatever the batch (torch's vectorised sigmoid is not: its bits for a row
depend on where the row falls in the batch). When the weights need a gradient (training), the scores and
weights are computed with torch ops instead (differentiable, same formula) and only the group-limited
top-k selection is native. ``dispatch``
is a stable counting sort plus a parallel row gather; ``combine`` a per-token weighted sum in slot order;
``experts`` runs whole experts in parallel, one thread each, with single-threaded GEMMs (the reference's
multi-threaded BLAS calls are too small to split well across cores); ``fused_experts`` is dispatch + experts
+ combine in one op whose expert tasks gather their own rows. Only ``route`` has a backward; a call of the
others that needs gradients runs the differentiable reference (the registry routes it).
Legend as in ``glm5_core.ops.moe``.
"""
from __future__ import annotations

from typing import Mapping, Tuple

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks
from glm5_core.ops.moe import RENORM_EPS


def _slot_order_sum(weights: torch.Tensor) -> torch.Tensor:
    """Row sums [N, 1] added in slot order by elementwise ops, so a token's bits never depend on N
    (a reduction kernel may vectorise across rows differently for another batch size)."""
    total = weights[:, :1]
    for j in range(1, weights.shape[1]):
        total = total + weights[:, j:j + 1]
    return total


def route(logits, bias, *, top_k: int, score_func: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
          renormalize: bool = True, routed_scaling_factor: float = 1.0):
    """Returns (weights fp32 [N, K] (fp64 for fp64 logits), expert ids int32 [N, K])."""
    ct = _checks.compute_dtype(logits.dtype)
    logits = logits.to(ct)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return torch.ops.glm5_cpu.moe_route(logits, bias, top_k, score_func == "sigmoid", n_group, topk_group,
                                            renormalize, float(routed_scaling_factor))
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)  # [N, E]
    select = scores if bias is None else scores + bias.to(ct)  # [N, E]
    ids = torch.ops.glm5_cpu.moe_select(select.detach(), top_k, n_group, topk_group)  # int64 [N, K]
    weights = scores.gather(1, ids)  # unbiased [N, K]
    if renormalize:
        weights = weights / (_slot_order_sum(weights) + RENORM_EPS)
    weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def _on_cpu(t: torch.Tensor) -> Tuple[bool, str]:
    if t.device.type != "cpu":
        return False, f"native CPU kernels need CPU tensors, got {t.device}"
    return True, ""


def _route_supports(logits, bias, **kwargs):
    return _on_cpu(logits)


def dispatch(x, expert_ids, *, num_experts: int):
    """Returns (x_sorted [M, D], sort_idx int64 [M], counts int64 [E])."""
    return torch.ops.glm5_cpu.moe_dispatch(x, expert_ids, num_experts)


def _dispatch_supports(x, expert_ids, *, num_experts: int):
    return _on_cpu(x)


def experts(x_sorted, counts, w_gate, w_up, w_down):
    """y [M, D] in x_sorted's dtype (computed in fp32, fp64 for fp64 inputs, as the reference)."""
    return torch.ops.glm5_cpu.moe_experts(x_sorted, counts, w_gate, w_up, w_down)


def _experts_supports(x_sorted, counts, w_gate, w_up, w_down):
    return _on_cpu(x_sorted)


def fused_experts(x, weights, expert_ids, w_gate, w_up, w_down):
    """out [N, D]: dispatch, experts and combine in one native op (no [M, D] copy of the inputs)."""
    return torch.ops.glm5_cpu.moe_fused_experts(x, weights, expert_ids, w_gate, w_up, w_down)


def _fused_supports(x, weights, expert_ids, w_gate, w_up, w_down):
    return _on_cpu(x)


def combine(y_sorted, sort_idx, weights):
    """out [N, D] in y_sorted's dtype: the weighted sum of each token's K expert rows, in slot order."""
    return torch.ops.glm5_cpu.moe_combine(y_sorted, sort_idx, weights)


def _combine_supports(y_sorted, sort_idx, weights):
    return _on_cpu(y_sorted)


KERNELS: Mapping[str, Kernel] = {
    # with gradients, route's weights come from torch ops on the native selection: it is differentiable
    "moe_route": Kernel(route, supports=_route_supports, differentiable=True),
    "moe_dispatch": Kernel(dispatch, supports=_dispatch_supports),
    "moe_combine": Kernel(combine, supports=_combine_supports),
    "moe_experts": Kernel(experts, supports=_experts_supports),
    "moe_fused_experts": Kernel(fused_experts, supports=_fused_supports),
}
