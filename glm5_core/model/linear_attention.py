"""KDA (Kimi Delta Attention) linear-attention layer of GLM-5.3 (transformers' ``glm5_next``), built on
``glm5_core.ops.kda``.

Legend: B batch, T new tokens, D hidden_size, H linear_num_heads, K linear_head_dim (keys and values alike),
W linear_conv_kernel_dim, E = 3 H K the conv channels (q, k and v side by side).

  x -> q_proj / k_proj / v_proj [H K each] -> short causal conv (``conv1d``, depthwise, width W, SiLU) -> q, k, v
  x -> forget_gate: f_b_proj(f_a_proj(x)) + dt_bias -> g = lower_bound * sigmoid(exp(A_log) g)   (fp32, <= 0)
                                                   (no lower bound: g = -exp(A_log) softplus(g))
  x -> b_proj -> sigmoid -> beta [H]
  (q, k l2-normalised, q scaled by K ** -0.5) -> KDA (chunked for prefill / training, recurrent for decode)
  -> o_norm: RMSNorm over each head's K values, times sigmoid(g_b_proj(g_a_proj(x))) -> o_proj [D]

The parameter names are those of transformers' ``Glm5NextTextLinearAttention`` (transformers 5.25
``models/glm5_next/modeling_glm5_next.py``), so a checkpoint's ``...linear_attn.*`` tensors load 1:1.
The state between calls (:class:`KDAState`) is the conv's last W - 1 inputs and the recurrent state, both fp32
(fp64 for an fp64 model).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from glm5_core import registry
from glm5_core.ops import _checks, kda


@dataclasses.dataclass
class KDAState:
    """What a KDA layer carries from one call to the next.

    ``conv_state [B, W - 1, 3 H K]``: the conv's last W - 1 inputs (q, k, v channels); ``recurrent_state
    [B, H, K, K]``: the delta-rule state. Both in the compute dtype (fp32; fp64 for fp64 activations)."""

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.recurrent_state.shape[0]

    def nbytes(self) -> int:
        return self.conv_state.numel() * self.conv_state.element_size() + \
            self.recurrent_state.numel() * self.recurrent_state.element_size()

    def index_select(self, rows: torch.Tensor) -> KDAState:
        """The state of the batch rows ``rows`` (beam / batch reordering)."""
        return KDAState(self.conv_state.index_select(0, rows), self.recurrent_state.index_select(0, rows))


class KDAForgetGate(nn.Module):
    """The per-channel log forget gate g [B, T, H, K], fp32 (transformers' ``Glm5NextTextForgetGate``)."""

    def __init__(self, *, hidden_size: int, linear_num_heads: int, linear_head_dim: int,
                 linear_lower_bound: Optional[float]):
        super().__init__()
        self.head_dim = linear_head_dim
        self.num_heads = linear_num_heads
        qkv_dim = linear_num_heads * linear_head_dim
        self.f_a_proj = nn.Linear(hidden_size, linear_head_dim, bias=False)
        self.f_b_proj = nn.Linear(linear_head_dim, qkv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(qkv_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(linear_num_heads, dtype=torch.float32))
        self.lower_bound = linear_lower_bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = _checks.compute_dtype(x.dtype)
        B, T = x.shape[:2]
        gate = _checks.cast(self.f_b_proj(self.f_a_proj(x)), ct) + _checks.cast(self.dt_bias, ct)
        gate = gate.view(B, T, self.num_heads, self.head_dim)
        rate = _checks.cast(self.A_log, ct).exp().view(1, 1, self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * gate)
        return -rate * torch.where(gate > 20.0, gate, torch.log1p(torch.exp(gate)))


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim in the compute dtype, times sigmoid(gate), cast back to x's dtype
    (transformers' ``Glm5NextTextRMSNormGated``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        ct = _checks.compute_dtype(x.dtype)
        xc = _checks.cast(x, ct)
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps) * _checks.cast(self.weight, ct)
        return _checks.cast(y * torch.sigmoid(_checks.cast(gate, ct)), x.dtype)


class KimiDeltaAttention(nn.Module):
    """One KDA layer (transformers' ``Glm5NextTextLinearAttention``).

    Constructor arguments, named as the ``Glm5NextTextConfig`` fields they come from:
      ``hidden_size`` (D), ``linear_num_heads`` (H), ``linear_head_dim`` (K), ``linear_conv_kernel_dim`` (W),
      ``linear_lower_bound`` (the forget gate's lower bound, None for the softplus gate), ``hidden_act`` (the
      conv's activation: "silu"), ``rms_norm_eps`` (o_norm's eps);
    and ours: ``chunk_size`` (of the chunked form), ``backend`` (the registry backend of the KDA ops, a name or a
    ``registry.Binding``; None: the default resolution), bound when the layer is built (``kernels``).

    Parameters (state-dict keys as transformers'): q_proj, k_proj, v_proj, conv1d.weight [3 H K, 1, W] (fp32, as
    transformers keeps it), forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}, b_proj, g_a_proj, g_b_proj,
    o_norm.weight [K], o_proj.
    """

    def __init__(self, *, hidden_size: int, linear_num_heads: int, linear_head_dim: int,
                 linear_conv_kernel_dim: int = 4, linear_lower_bound: Optional[float] = -5.0,
                 hidden_act: str = "silu", rms_norm_eps: float = 1e-5, chunk_size: int = kda.DEFAULT_CHUNK_SIZE,
                 backend: registry.BackendArg = None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("linear_num_heads", linear_num_heads),
                            ("linear_head_dim", linear_head_dim), ("linear_conv_kernel_dim", linear_conv_kernel_dim),
                            ("chunk_size", chunk_size)):
            _checks.positive_int(name, value)
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act: expected 'silu' (the KDA conv's activation), got {hidden_act!r}")
        if linear_lower_bound is not None:
            if isinstance(linear_lower_bound, bool) or not isinstance(linear_lower_bound, (int, float)) \
                    or not linear_lower_bound < 0:
                raise ValueError(f"linear_lower_bound: expected None or a number < 0, got {linear_lower_bound!r}")
            linear_lower_bound = float(linear_lower_bound)
        _checks.positive_float("rms_norm_eps", rms_norm_eps)
        self.hidden_size = hidden_size
        self.num_heads = linear_num_heads
        self.head_dim = linear_head_dim
        self.qkv_dim = linear_num_heads * linear_head_dim
        self.conv_kernel_size = linear_conv_kernel_dim
        self.chunk_size = chunk_size
        self.backend = backend  # as asked for
        self.kernels = registry.bind(backend)  # resolved once, here (GLM5ForCausalLM.bind_backend rebinds it)

        self.q_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.conv_dim = 3 * self.qkv_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=linear_conv_kernel_dim,
                                groups=self.conv_dim, padding=linear_conv_kernel_dim - 1, bias=False,
                                dtype=torch.float32)
        self.forget_gate = KDAForgetGate(hidden_size=hidden_size, linear_num_heads=linear_num_heads,
                                         linear_head_dim=linear_head_dim, linear_lower_bound=linear_lower_bound)
        self.b_proj = nn.Linear(hidden_size, linear_num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, linear_head_dim, bias=False)
        self.g_b_proj = nn.Linear(linear_head_dim, self.qkv_dim, bias=False)
        self.o_norm = GatedRMSNorm(linear_head_dim, rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, hidden_size, bias=False)

    @classmethod
    def from_config(cls, config, **kwargs) -> KimiDeltaAttention:
        """From any object with the ``Glm5NextTextConfig`` fields (transformers' config, or ours)."""
        fields = ("hidden_size", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
                  "linear_lower_bound", "hidden_act", "rms_norm_eps")
        return cls(**{f: getattr(config, f) for f in fields}, **kwargs)

    def init_state(self, batch_size: int, *, dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None) -> KDAState:
        """The state of a fresh sequence (zeros): what ``forward(..., state=None, use_cache=True)`` starts from."""
        ct = _checks.compute_dtype(dtype)
        device = device if device is not None else self.q_proj.weight.device
        return KDAState(torch.zeros(batch_size, self.conv_kernel_size - 1, self.conv_dim, dtype=ct, device=device),
                        torch.zeros(batch_size, self.num_heads, self.head_dim, self.head_dim, dtype=ct, device=device))

    def _check_state(self, state: KDAState, x: torch.Tensor) -> None:
        if not isinstance(state, KDAState):
            raise TypeError(f"state: expected a KDAState or None, got {type(state).__name__}")
        B = x.shape[0]
        ct = _checks.compute_dtype(x.dtype)
        want = {"conv_state": (B, self.conv_kernel_size - 1, self.conv_dim),
                "recurrent_state": (B, self.num_heads, self.head_dim, self.head_dim)}
        for name, shape in want.items():
            t = getattr(state, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != ct or t.device != x.device:
                got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"state.{name}: expected {list(shape)} {ct} on {x.device}, got {got}")

    def forward(self, hidden: torch.Tensor, state: Optional[KDAState] = None, *, use_cache: bool = False,
                attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[KDAState]]:
        """``hidden [B, T, D]`` continuing from ``state`` (None: a fresh sequence). Returns ``(out [B, T, D],
        new state)``: the new state when ``use_cache`` (or a state was given), else None.

        A call of one token with a state is a decode step (the conv's update form and the recurrent KDA);
        otherwise the conv runs over the sequence and KDA in the chunked form (from the state if any).
        ``attention_mask [B, T]`` (1 keep, 0 padding) zeroes padded tokens' inputs, as transformers does."""
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden: expected [B, T, {self.hidden_size}], got {got}")
        if state is not None:
            self._check_state(state, hidden)
        keep_state = use_cache or state is not None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
                raise ValueError(f"attention_mask: expected [B, T] = {list(hidden.shape[:2])}, "
                                 f"got {tuple(attention_mask.shape)}")
            hidden = (hidden * attention_mask[:, :, None]).to(hidden.dtype)
        B, T, _ = hidden.shape
        H, K = self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)  # [B, T, E]
        weight = self.conv1d.weight.squeeze(1)  # [E, W]
        decode = state is not None and T == 1
        # a decode step's tensors are all built here and _check_state checked the state: its two KDA ops go
        # straight to the bound kernels with the arguments their entry points would pass, without the entry
        # points' checks (~15 tensor checks a step, as the mHC mix and the MoE experts do)
        if decode:
            mixed, conv_state = registry.call("kda_causal_conv_update", mixed[:, 0], state.conv_state, weight, None,
                                              activation="silu", backend=self.kernels)
            mixed = mixed.unsqueeze(1)
        else:
            mixed, conv_state = kda.causal_conv(mixed, weight, conv_state=None if state is None else state.conv_state,
                                                activation="silu", output_final_state=keep_state,
                                                backend=self.kernels)
        q, k, v = (t.reshape(B, T, H, K) for t in mixed.split(self.qkv_dim, dim=-1))
        g = self.forget_gate(hidden)  # [B, T, H, K], compute dtype
        beta = torch.sigmoid(self.b_proj(hidden))  # [B, T, H]
        initial = None if state is None else state.recurrent_state
        if decode:
            o, recurrent_state = registry.call("kda_recurrent", q, k, v, g, beta, scale=None, initial_state=initial,
                                               output_final_state=True, use_qk_l2norm=True, backend=self.kernels)
        else:
            o, recurrent_state = kda.chunked(q, k, v, g, beta, initial_state=initial, output_final_state=keep_state,
                                             chunk_size=self.chunk_size, use_qk_l2norm=True, backend=self.kernels)
        gate = self.g_b_proj(self.g_a_proj(hidden)).view(B, T, H, K)
        out = self.o_proj(self.o_norm(o, gate).reshape(B, T, H * K))
        return out, (KDAState(conv_state, recurrent_state) if keep_state else None)


def state_bytes(*, batch_size: int, linear_num_heads: int, linear_head_dim: int, linear_conv_kernel_dim: int,
                dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one layer's :class:`KDAState` (independent of the sequence length)."""
    itemsize = torch.empty((), dtype=_checks.compute_dtype(dtype)).element_size()
    qkv = linear_num_heads * linear_head_dim
    return batch_size * itemsize * ((linear_conv_kernel_dim - 1) * 3 * qkv + linear_num_heads * linear_head_dim ** 2)


__all__ = ["GatedRMSNorm", "KDAForgetGate", "KDAState", "KimiDeltaAttention", "state_bytes"]
