"""cpu backend native kernels for KDA's decode path: the recurrent form (``kda_recurrent``) and the short causal conv
(``kda_causal_conv``, ``kda_causal_conv_update``), in csrc/cpu_kda.cpp.

Each takes exactly the arguments of its reference (``glm5_core.ops.kda``), already validated. q, k, v and x are read
in their own dtype (fp32, fp64, bf16, fp16) and strides (the model passes slices of one projection); g, beta, the
conv weight and bias are taken in the compute dtype (a no-op cast for the fp32 model). A decode step is one C++ call:
the state is read once and written once, per (batch row, head) in parallel with every sum inside one work item, so
the results are bitwise the same for any thread count (tests/backends/cpu/test_kda_native.py).

Gradients: ``kda_recurrent`` and ``kda_causal_conv_update`` are not differentiable ops. ``kda_causal_conv`` is; its
native kernel is forward only (``differentiable=False``), so a call that needs gradients (training) runs the
differentiable reference, as the registry routes it, and inference / prefill without gradients runs natively.
Legend as in ``glm5_core.ops.kda``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks

MAX_CONV_WIDTH = 8  # the widths the C++ conv instantiates (GLM-5.3's linear_conv_kernel_dim is 4)


def recurrent(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
              output_final_state: bool = False, use_qk_l2norm: bool = False):
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] in the compute dtype or None)."""
    ct = _checks.compute_dtype(q.dtype)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, state = torch.ops.glm5_cpu.kda_recurrent(q, k, v, g.to(ct), beta.to(ct), initial_state, float(scale),
                                                use_qk_l2norm)
    return o, (state if output_final_state else None)


def causal_conv(x, weight, bias=None, *, conv_state=None, activation: Optional[str] = "silu",
                output_final_state: bool = False):
    """(out [B, T, D] in x's dtype, new state [B, W - 1, D] in the compute dtype or None)."""
    ct = _checks.compute_dtype(x.dtype)
    out, state = torch.ops.glm5_cpu.kda_causal_conv(
        x, weight.to(ct), None if bias is None else bias.to(ct), None if conv_state is None else conv_state.to(ct),
        activation == "silu")
    return out, (state if output_final_state else None)


def causal_conv_update(x, conv_state, weight, bias=None, *, activation: Optional[str] = "silu"):
    """One step, x [B, D]: (out [B, D] in x's dtype, new state [B, W - 1, D] in the compute dtype)."""
    ct = _checks.compute_dtype(x.dtype)
    out, state = torch.ops.glm5_cpu.kda_causal_conv(
        x.unsqueeze(1), weight.to(ct), None if bias is None else bias.to(ct), conv_state.to(ct), activation == "silu")
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
    "kda_causal_conv": Kernel(causal_conv, supports=_conv_supports),
    "kda_causal_conv_update": Kernel(causal_conv_update, supports=_conv_update_supports),
}
