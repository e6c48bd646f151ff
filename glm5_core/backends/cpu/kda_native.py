"""cpu backend native kernels for KDA's decode path: the recurrent form (``kda_recurrent``) and the short causal conv
(``kda_causal_conv``, ``kda_causal_conv_update``), in csrc/cpu_kda.cpp.

Each takes exactly the arguments of its reference (``glm5_core.ops.kda``), already validated. q, k, v and x are read
in their own dtype (fp32, fp64, bf16, fp16) and strides (the model passes slices of one projection); g, beta, the
conv weight and bias are taken in the compute dtype (a no-op cast for the fp32 model). A decode step is one C++ call:
the state is read once and written once, per (batch row, head) in parallel with every sum inside one work item, so
the results are bitwise the same for any thread count (tests/backends/cpu/test_kda_native.py).

Gradients: ``kda_recurrent`` and ``kda_causal_conv_update`` are not differentiable ops. ``kda_causal_conv`` is: a
call that needs gradients runs the native forward under an ``autograd.Function`` whose backward is the native
``kda_causal_conv_backward`` (the pre-activation recomputed, the weight / bias gradients summed per channel over
(batch, token) in that order, so they too are bitwise the same for any thread count).
Legend as in ``glm5_core.ops.kda``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from glm5_core.kernel import Kernel, needs_grad
from glm5_core.ops import _checks

MAX_CONV_WIDTH = 8  # the widths the C++ conv instantiates (GLM-5.3's linear_conv_kernel_dim is 4)


def recurrent(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
              output_final_state: bool = False, use_qk_l2norm: bool = False):
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] in the compute dtype or None)."""
    ct = _checks.compute_dtype(q.dtype)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, state = torch.ops.glm5_cpu.kda_recurrent(q, k, v, _checks.cast(g, ct), _checks.cast(beta, ct), initial_state,
                                                float(scale), use_qk_l2norm)
    return o, (state if output_final_state else None)


class _CausalConv(torch.autograd.Function):
    """The native conv with its native backward; the gradients come back in each input's own dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv_state, silu: bool):
        ct = _checks.compute_dtype(x.dtype)
        w, b = weight.to(ct), None if bias is None else bias.to(ct)
        s = None if conv_state is None else conv_state.to(ct)
        out, state = torch.ops.glm5_cpu.kda_causal_conv(x, w, b, s, silu)
        ctx.save_for_backward(x, w, b, s)
        ctx.silu = silu
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype,
                      None if conv_state is None else conv_state.dtype)
        ctx.set_materialize_grads(False)
        return out, state

    @staticmethod
    def backward(ctx, grad_out, grad_state):
        x, w, b, s = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(x)
        dx, dw, db, ds = torch.ops.glm5_cpu.kda_causal_conv_backward(grad_out, grad_state, x, w, b, s, ctx.silu)
        w_dtype, b_dtype, s_dtype = ctx.dtypes
        return (dx, dw.to(w_dtype), None if b is None else db.to(b_dtype), None if s is None else ds.to(s_dtype),
                None)


def causal_conv(x, weight, bias=None, *, conv_state=None, activation: Optional[str] = "silu",
                output_final_state: bool = False):
    """(out [B, T, D] in x's dtype, new state [B, W - 1, D] in the compute dtype or None); differentiable."""
    silu = activation == "silu"
    if needs_grad(x, weight, bias, conv_state):
        out, state = _CausalConv.apply(x, weight, bias, conv_state, silu)
    else:
        ct = _checks.compute_dtype(x.dtype)
        out, state = torch.ops.glm5_cpu.kda_causal_conv(
            x, weight.to(ct), None if bias is None else bias.to(ct),
            None if conv_state is None else conv_state.to(ct), silu)
    return out, (state if output_final_state else None)


def causal_conv_update(x, conv_state, weight, bias=None, *, activation: Optional[str] = "silu"):
    """One step, x [B, D]: (out [B, D] in x's dtype, new state [B, W - 1, D] in the compute dtype)."""
    ct = _checks.compute_dtype(x.dtype)
    out, state = torch.ops.glm5_cpu.kda_causal_conv(
        x.unsqueeze(1), _checks.cast(weight, ct), None if bias is None else _checks.cast(bias, ct),
        _checks.cast(conv_state, ct), activation == "silu")
    return out.squeeze(1), state


def _on_cpu(*tensors) -> tuple[bool, str]:
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices != {"cpu"}:
        return False, f"native CPU kernels need CPU tensors, got {sorted(devices)}"
    return True, ""


def _recurrent_supports(q, k, v, g, beta, **kwargs):
    return _on_cpu(q, k, v, g, beta, kwargs.get("initial_state"))


def _conv_supports(x, weight, bias=None, **kwargs):
    if weight.shape[-1] > MAX_CONV_WIDTH:
        return False, f"conv width {weight.shape[-1]} > {MAX_CONV_WIDTH}, the widest the native conv is built for"
    return _on_cpu(x, weight, bias, kwargs.get("conv_state"))


def _conv_update_supports(x, conv_state, weight, bias=None, **kwargs):
    return _conv_supports(x, weight, bias, conv_state=conv_state)


KERNELS: Mapping[str, Kernel] = {
    "kda_recurrent": Kernel(recurrent, supports=_recurrent_supports),
    "kda_causal_conv": Kernel(causal_conv, supports=_conv_supports, differentiable=True),
    "kda_causal_conv_update": Kernel(causal_conv_update, supports=_conv_update_supports),
}
