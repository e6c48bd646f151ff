"""RMSNorm (the model's norms; k_norm of the indexer is a torch LayerNorm with bias).

Legend: R the leading (row) dims, D the normalised width; the compute dtype is fp32 (fp64 for fp64 inputs).

y = weight * (x * rsqrt(mean(x^2) + eps)), computed in the compute dtype and cast back to x's dtype before the
weight. With gradients it runs through ``_RMSNormFunction``: the same forward ops, and a backward written out by
hand that reproduces, bit for bit, every rounding autograd's chain of the composition makes (the same torch
ops on the same operands; only the passes that merely copy or broadcast are left out):

  g_n  = g * weight                 (grad of the normalised x, in x's dtype, then the compute dtype)
  g_r  = sum_D(g_n * x)             [R, 1]  (the grad of rsqrt's output)
  g_m  = (-0.5 * g_r) * r^3         [R, 1]  (rsqrt's backward; the mean's grad, eps added nothing)
  dx   = g_n * r + ((g_m / D) * 2) * x      (the product's and the square's paths; the mean's backward is
                                             g_m / D broadcast, the square's grad * (2 * x), and doubling is
                                             exact, so (g_m / D) * 2 * x rounds exactly as autograd's)
  dweight = sum_R(g * n)            [D]

About half the full-size passes of autograd's version (which broadcasts the mean's gradient to a full
tensor, copies x for ``x.pow(1)`` and doubles it in a pass of its own). No double backward (create_graph=True
raises); under torch.compile the composition itself is traced.
"""
from __future__ import annotations

import torch
from torch import nn

from glm5_core.ops import _checks


def _normalise(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x in the compute dtype, rsqrt(mean(x^2) + eps) [R, 1], normalised x in x's dtype)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = _checks.cast(x, compute)
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)  # [R, 1]
    return xc, r, _checks.cast(xc * r, x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """x comes in twice, as the two operands autograd's chain differentiates: ``x_times_r`` (in x * r) and
    ``x_squared`` (in x^2). When x is already in the compute dtype (no cast node between them and x), autograd
    adds those two gradients into x's gradient buffer one at a time, the product's first, after whatever
    arrived there before (the residual stream's): returning them as two gradients keeps that order of the
    additions. With a cast, the cast's backward adds the two first (one gradient for x)."""

    @staticmethod
    def forward(ctx, x_times_r: torch.Tensor, x_squared: torch.Tensor, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
        xc, r, normed = _normalise(x_times_r, eps)
        ctx.save_for_backward(xc, r, normed, weight)
        ctx.x_dtype = x_times_r.dtype
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: these ops would miss the saved r's own dependence on x
            raise RuntimeError("RMSNorm: a double backward (create_graph=True) is not supported")
        xc, r, normed, weight = ctx.saved_tensors
        grad_times_r = grad_squared = grad_weight = None
        if ctx.needs_input_grad[2]:
            leading = tuple(range(grad.dim() - weight.dim()))
            grad_weight = (grad * normed).sum(leading).to(weight.dtype)  # [D], autograd's sum_to
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_n = (grad * weight).to(ctx.x_dtype).to(xc.dtype)  # [R, D]
            grad_r = (grad_n * xc).sum(-1, keepdim=True)  # [R, 1]
            grad_m = -0.5 * grad_r * r.pow(3)  # [R, 1]
            square_scale = (grad_m / xc.shape[-1]) * 2  # [R, 1]
            grad_times_r, grad_squared = grad_n * r, square_scale * xc  # [R, D] each
            if ctx.x_dtype != xc.dtype:  # the cast's backward: one gradient, the sum, in x's dtype
                grad_times_r, grad_squared = (grad_times_r + grad_squared).to(ctx.x_dtype), None
        return grad_times_r, grad_squared, grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.compile traces the composition (it fuses it itself; dynamo breaks the graph on a Function given
        # one tensor twice)
        training = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if training and not torch.compiler.is_compiling():
            return _RMSNormFunction.apply(x, x, self.weight, self.eps)
        return self.weight * _normalise(x, self.eps)[2]
