"""cpu backend kernels for MoE: routing selection, dispatch and combine.

``route`` runs the whole routing contract natively, row by row in scalar code, so a token's ids and
weights are bitwise the same whatever the batch (torch's vectorised sigmoid is not: its bits for a row
depend on where the row falls in the batch). When the weights need a gradient (training), the scores and
weights are computed with torch ops instead (differentiable, same formula) and only the group-limited
top-k selection is native. ``dispatch``
is a stable counting sort plus a parallel row gather; ``combine`` a per-token weighted sum in slot order;
``experts`` runs whole experts in parallel, one thread each, with single-threaded GEMMs (the reference's
multi-threaded BLAS calls are too small to split well across cores); ``fused_experts`` is dispatch + experts
+ combine in one op whose expert tasks gather their own rows, with a native backward (per expert, on its own
rows only) when gradients are needed. ``dispatch`` and ``combine`` are differentiable too (their backwards are
gathers and slot-order sums over the routed rows; the unfused ``experts`` stays forward-only).
Legend as in ``glm5_core.ops.moe``.
"""
from __future__ import annotations

from collections.abc import Mapping

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


def _on_cpu(t: torch.Tensor) -> tuple[bool, str]:
    if t.device.type != "cpu":
        return False, f"native CPU kernels need CPU tensors, got {t.device}"
    return True, ""


def _route_supports(logits, bias, **kwargs):
    return _on_cpu(logits)


class _Dispatch(torch.autograd.Function):
    """Native dispatch; its backward sums each token's K row gradients in slot order (the native combine with
    unit weights: 1 * g is exact), so dx is deterministic and costs O(N K D) whatever E is."""

    @staticmethod
    def forward(ctx, x, expert_ids, num_experts):
        x_sorted, sort_idx, counts = torch.ops.glm5_cpu.moe_dispatch(x, expert_ids, num_experts)
        ctx.mark_non_differentiable(sort_idx, counts)
        ctx.save_for_backward(sort_idx)
        ctx.slots = expert_ids.shape  # (N, K)
        return x_sorted, sort_idx, counts

    @staticmethod
    def backward(ctx, grad_x_sorted, _grad_sort_idx, _grad_counts):
        (sort_idx,) = ctx.saved_tensors
        ones = grad_x_sorted.new_ones(ctx.slots, dtype=_checks.compute_dtype(grad_x_sorted.dtype))  # [N, K]
        return torch.ops.glm5_cpu.moe_combine(grad_x_sorted, sort_idx, ones), None, None


def dispatch(x, expert_ids, *, num_experts: int):
    """Returns (x_sorted [M, D], sort_idx int64 [M], counts int64 [E])."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Dispatch.apply(x, expert_ids, num_experts)
    return torch.ops.glm5_cpu.moe_dispatch(x, expert_ids, num_experts)




def _dispatch_supports(x, expert_ids, *, num_experts: int):
    return _on_cpu(x)


def experts(x_sorted, counts, w_gate, w_up, w_down, *, swiglu_limit=None):
    """y [M, D] in x_sorted's dtype (computed in fp32, fp64 for fp64 inputs, as the reference); ``swiglu_limit``:
    the clamped SwiGLU."""
    return torch.ops.glm5_cpu.moe_experts(x_sorted, counts, w_gate, w_up, w_down, swiglu_limit)


def _experts_supports(x_sorted, counts, w_gate, w_up, w_down, **kwargs):
    return _on_cpu(x_sorted)


class _FusedExperts(torch.autograd.Function):
    """The native fused experts with the native backward: the forward keeps the gate / up projections [M, F]
    (in the compute dtype) and the expert sort; the backward recomputes nothing else (see
    ``moe_fused_experts_backward`` in csrc/cpu_moe.cpp). Gradients to x, the routing weights and the three
    expert weight stacks; none to the integer ids."""

    @staticmethod
    def forward(ctx, x, weights, expert_ids, w_gate, w_up, w_down, swiglu_limit):
        out, gate, up, sort_idx, counts = torch.ops.glm5_cpu.moe_fused_experts_train(x, weights, expert_ids, w_gate,
                                                                                      w_up, w_down, swiglu_limit)
        ctx.save_for_backward(x, weights, sort_idx, counts, gate, up, w_gate, w_up, w_down)  # not outputs
        ctx.swiglu_limit = swiglu_limit
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = torch.ops.glm5_cpu.moe_fused_experts_backward(grad_out, *ctx.saved_tensors,
                                                              ctx.swiglu_limit)  # dx, dw, dWg, dWu, dWd
        dx, dweights, dw_gate, dw_up, dw_down = (g if need else None for g, need in
                                                 zip(grads, [ctx.needs_input_grad[i] for i in (0, 1, 3, 4, 5)]))
        return dx, dweights, None, dw_gate, dw_up, dw_down, None


def fused_experts(x, weights, expert_ids, w_gate, w_up, w_down, *, swiglu_limit=None):
    """out [N, D]: dispatch, experts and combine in one native op (no [M, D] copy of the inputs); with
    gradients, the same forward through the native backward."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, w_gate, w_up, w_down)):
        return _FusedExperts.apply(x, weights, expert_ids, w_gate, w_up, w_down, swiglu_limit)
    return torch.ops.glm5_cpu.moe_fused_experts(x, weights, expert_ids, w_gate, w_up, w_down, swiglu_limit)




def _fused_supports(x, weights, expert_ids, w_gate, w_up, w_down, **kwargs):
    return _on_cpu(x)


class _Combine(torch.autograd.Function):
    """Native combine; backward (in the compute dtype, as the reference): d y_sorted[r] = w(r) * grad_out[token(r)]
    (a row gather) and d weights[n, j] = <grad_out[n], y_sorted[row of (n, j)]>, both O(N K D) whatever E is."""

    @staticmethod
    def forward(ctx, y_sorted, sort_idx, weights):
        ctx.save_for_backward(y_sorted, sort_idx, weights)
        return torch.ops.glm5_cpu.moe_combine(y_sorted, sort_idx, weights)

    @staticmethod
    def backward(ctx, grad_out):
        y_sorted, sort_idx, weights = ctx.saved_tensors
        N, K = weights.shape
        ct = _checks.compute_dtype(y_sorted.dtype)
        order = sort_idx.to(torch.int64)
        grad = grad_out.to(ct)
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            w_sorted = weights.reshape(-1).to(ct).index_select(0, order).unsqueeze(1)  # [M, 1]
            grad_y = (grad.index_select(0, order // K) * w_sorted).to(y_sorted.dtype)  # [M, D]
        if ctx.needs_input_grad[2]:
            row_of = torch.empty_like(order)
            row_of[order] = torch.arange(order.numel())  # flat assignment -> sorted row
            y = y_sorted.to(ct).index_select(0, row_of).view(N, K, -1)  # [N, K, D]
            grad_w = (y * grad.unsqueeze(1)).sum(-1).to(weights.dtype)  # [N, K]
        return grad_y, None, grad_w


def combine(y_sorted, sort_idx, weights):
    """out [N, D] in y_sorted's dtype: the weighted sum of each token's K expert rows, in slot order."""
    if torch.is_grad_enabled() and (y_sorted.requires_grad or weights.requires_grad):
        return _Combine.apply(y_sorted, sort_idx, weights)
    return torch.ops.glm5_cpu.moe_combine(y_sorted, sort_idx, weights)




def _combine_supports(y_sorted, sort_idx, weights):
    return _on_cpu(y_sorted)


KERNELS: Mapping[str, Kernel] = {
    # with gradients, route's weights come from torch ops on the native selection: it is differentiable
    "moe_route": Kernel(route, supports=_route_supports, differentiable=True),
    "moe_dispatch": Kernel(dispatch, supports=_dispatch_supports, differentiable=True),  # _Dispatch
    "moe_combine": Kernel(combine, supports=_combine_supports, differentiable=True),  # _Combine
    "moe_experts": Kernel(experts, supports=_experts_supports),
    # native backward (moe_fused_experts_backward), per expert over its own rows
    "moe_fused_experts": Kernel(fused_experts, supports=_fused_supports, differentiable=True),
}
