"""KDA (Kimi Delta Attention): the gated delta rule with a per-channel forget gate, and its short causal conv.

The ops of this family (``OPS`` declares them):
  ``kda_chunked`` (entry point ``chunked``, reference ``chunked_reference``): the chunked parallel form, for
  prefill and training (differentiable);
  ``kda_recurrent`` (``recurrent``, ``recurrent_reference``): the token-by-token form, for decode;
  ``kda_causal_conv`` (``causal_conv``, ``causal_conv_reference``): the depthwise short causal conv over a
  sequence, with its state in and out (differentiable);
  ``kda_causal_conv_update`` (``causal_conv_update``, ``causal_conv_update_reference``): one decode step of it.

Legend (sizes): B batch, T tokens, H heads, K key head dim, V value head dim, D conv channels, W conv width.
  q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] the log forget gate (<= 0; GLM-5.3 bounds it below by
  ``linear_lower_bound``); beta [B, T, H] the write strength; state [B, H, K, V].

The recurrence (``recurrent_reference`` is it, written out), per batch row and head, token t:
  S = diag(exp(g_t)) S                      decay each key channel of the state
  u = beta_t (v_t - S^T k_t)                the delta rule: write what the state does not yet predict
  S = S + k_t u^T
  o_t = S^T (scale q_t)
q and k are first L2-normalised when ``use_qk_l2norm`` (x / sqrt(sum x^2 + 1e-6), FLA's and transformers' form);
``scale`` defaults to K ** -0.5. The chunked form computes the same function: inside a chunk of ``chunk_size``
tokens with Gamma the in-chunk cumulative sum of g and S0 the state entering the chunk,
  (I + L) U = beta (V - (k exp(Gamma)) S0),   L_ij = beta_i sum_d k_id k_jd exp(Gamma_id - Gamma_jd) for j < i,
  o_i = (q_i exp(Gamma_i)) S0 + sum_{j <= i} (sum_d q_id k_jd exp(Gamma_id - Gamma_jd)) U_j,
  S_C = diag(exp(Gamma_C)) S0 + sum_j (k_j exp(Gamma_C - Gamma_j)) U_j^T,
so only differences Gamma_i - Gamma_j with i >= j (<= 0) are exponentiated: nothing overflows, whatever g.

Precision: everything runs in fp32 (fp64 for fp64 inputs); the state is kept in that dtype whatever the input
dtype (an fp32 ``initial_state`` for bf16 / fp16 inputs), and the outputs are cast back to the input dtype.

The conv: out_t = act(bias + sum_w weight[:, w] * x_{t - W + 1 + w}), channels-last x [B, T, D], weight
[D, W] (``nn.Conv1d``'s [D, 1, W] squeezed), with x_{<0} read from ``conv_state`` [B, W - 1, D] (zeros when
None: a fresh sequence). The new state is the last W - 1 inputs, fp32 (fp64 for fp64 inputs), so that a
prefill then decode steps equals one longer prefill. ``activation`` is "silu" (GLM-5.3's ``hidden_act``) or
None; sums run in fp32 in tap order.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from glm5_core import registry
from glm5_core.ops import _checks
from glm5_core.opspec import OpSpec

L2NORM_EPS = 1e-6
DEFAULT_CHUNK_SIZE = 64
ACTIVATIONS = ("silu", None)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's form: + eps, not a max)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """The inputs in the compute dtype, q and k normalised (if asked) and q scaled."""
    ct = _checks.compute_dtype(q.dtype)
    q, k, v, g, beta = (t.to(ct) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k, v, g, beta, ct


def _initial(initial_state, B, H, K, V, ct, device):
    if initial_state is None:
        return torch.zeros(B, H, K, V, dtype=ct, device=device)
    return initial_state.to(ct)


def recurrent_reference(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
                        output_final_state: bool = False, use_qk_l2norm: bool = False):
    """The recurrence token by token. Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] in the
    compute dtype or None)."""
    out_dtype = q.dtype
    q, k, v, g, beta, ct = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = _initial(initial_state, B, H, K, V, ct, q.device)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)  # [B, H, K, V]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))  # [B, H, V]
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)


def _pad_chunks(x: torch.Tensor, T: int, C: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...] (zero padded to N * C tokens; padded tokens have g = 0, beta = 0,
    so they leave the state unchanged)."""
    pad = (-T) % C
    x = x.movedim(1, 2)  # [B, H, T, ...]
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(*x.shape[:2], -1, C, *x.shape[3:])


def chunked_reference(q, k, v, g, beta, *, scale: Optional[float] = None, initial_state=None,
                      output_final_state: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      use_qk_l2norm: bool = False):
    """The chunked form (module docstring), one chunk at a time, the in-chunk pairwise decays written out.
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] in the compute dtype or None)."""
    out_dtype = q.dtype
    q, k, v, g, beta, ct = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    S = _initial(initial_state, B, H, K, V, ct, q.device)
    q, k, v, g = (_pad_chunks(t, T, C) for t in (q, k, v, g))  # [B, H, N, C, .]
    beta = _pad_chunks(beta, T, C)  # [B, H, N, C]
    eye = torch.eye(C, dtype=ct, device=q.device)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))  # j <= i
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=-1)  # j < i
    outs = []
    for n in range(q.shape[2]):
        qn, kn, vn, bn = q[:, :, n], k[:, :, n], v[:, :, n], beta[:, :, n]
        G = g[:, :, n].cumsum(dim=-2)  # [B, H, C, K]
        diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~lower.unsqueeze(-1), float("-inf"))  # [.., i, j, K]
        decay = diff.exp()  # exp(Gamma_i - Gamma_j) for j <= i, else 0
        kk = torch.einsum("bhik,bhjk,bhijk->bhij", kn, kn, decay).masked_fill(~strict, 0)
        unit = eye + bn.unsqueeze(-1) * kk  # I + L
        rhs = bn.unsqueeze(-1) * (vn - (kn * G.exp()) @ S)  # [B, H, C, V]
        U = torch.linalg.solve_triangular(unit, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("bhik,bhjk,bhijk->bhij", qn, kn, decay)  # zero above the diagonal
        outs.append((qn * G.exp()) @ S + qk @ U)
        last = G[:, :, -1:]  # [B, H, 1, K]
        S = S * last.transpose(-1, -2).exp() + (kn * (last - G).exp()).transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, H, -1, V)[:, :, :T].movedim(1, 2)
    return o.to(out_dtype), (S if output_final_state else None)


def _activate(x: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    return F.silu(x) if activation == "silu" else x


def causal_conv_reference(x, weight, bias=None, *, conv_state=None, activation: Optional[str] = "silu",
                          output_final_state: bool = False):
    """The conv over a sequence, tap by tap. Returns (out [B, T, D] in x's dtype, new state [B, W - 1, D] in the
    compute dtype or None)."""
    ct = _checks.compute_dtype(x.dtype)
    B, T, D = x.shape
    W = weight.shape[-1]
    w = weight.to(ct)
    if conv_state is None:
        conv_state = torch.zeros(B, W - 1, D, dtype=ct, device=x.device)
    full = torch.cat([conv_state.to(ct), x.to(ct)], dim=1)  # [B, W - 1 + T, D]
    acc = full[:, 0:T] * w[:, 0]
    for tap in range(1, W):
        acc = acc + full[:, tap:tap + T] * w[:, tap]
    if bias is not None:
        acc = acc + bias.to(ct)
    out = _activate(acc, activation).to(x.dtype)
    return out, (full[:, full.shape[1] - (W - 1):] if output_final_state else None)


def causal_conv_update_reference(x, conv_state, weight, bias=None, *, activation: Optional[str] = "silu"):
    """One step: x [B, D]. Returns (out [B, D] in x's dtype, new state [B, W - 1, D] in the compute dtype)."""
    out, state = causal_conv_reference(x.unsqueeze(1), weight, bias, conv_state=conv_state, activation=activation,
                                       output_final_state=True)
    return out.squeeze(1), state


OPS = (
    OpSpec("kda_chunked", chunked_reference, family="kda", differentiable=True),
    OpSpec("kda_recurrent", recurrent_reference, family="kda"),
    OpSpec("kda_causal_conv", causal_conv_reference, family="kda", differentiable=True),
    OpSpec("kda_causal_conv_update", causal_conv_update_reference, family="kda"),
)


# ------------------------------------------------------------------------------------------ entry points
def _validate_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm) -> dict[str, int]:
    sizes: dict[str, int] = {}
    _checks.tensor("q", q, dims=("B", "T", "H", "K"), sizes=sizes, legend="[B, T, H, K]")
    _checks.tensor("k", k, dims=("B", "T", "H", "K"), sizes=sizes, legend="[B, T, H, K]")
    _checks.tensor("v", v, dims=("B", "T", "H", "V"), sizes=sizes, legend="[B, T, H, V]")
    _checks.tensor("g", g, dims=("B", "T", "H", "K"), sizes=sizes, legend="[B, T, H, K]")
    _checks.tensor("beta", beta, dims=("B", "T", "H"), sizes=sizes, legend="[B, T, H]")
    _checks.same_dtype(q=q, k=k, v=v)
    _checks.same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if sizes["K"] < 1 or sizes["V"] < 1:
        raise ValueError(f"q / v: expected head dims K, V >= 1, got K={sizes['K']}, V={sizes['V']}")
    if initial_state is not None:
        _checks.tensor("initial_state", initial_state, dims=("B", "H", "K", "V"), sizes=sizes, legend="[B, H, K, V]")
        want = _checks.compute_dtype(q.dtype)
        if initial_state.dtype != want:
            raise TypeError(f"initial_state: expected {want} (the state is kept in the compute dtype of "
                            f"{q.dtype} inputs), got {initial_state.dtype}")
    if scale is not None:
        _checks.positive_float("scale", scale)
    for name, value in (("output_final_state", output_final_state), ("use_qk_l2norm", use_qk_l2norm)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return sizes


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
            scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
            output_final_state: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, use_qk_l2norm: bool = False,
            backend: registry.BackendArg = None):
    """KDA over ``T`` tokens in the chunked parallel form (prefill, training; differentiable).

    Returns ``(o [B, T, H, V], final_state [B, H, K, V] or None)``; the state is fp32 (fp64 for fp64 inputs),
    as ``initial_state`` must be. ``chunk_size`` changes only the rounding."""
    _validate_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)
    _checks.positive_int("chunk_size", chunk_size)
    return registry.call("kda_chunked", q, k, v, g, beta, scale=None if scale is None else float(scale),
                         initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                         use_qk_l2norm=use_qk_l2norm, backend=backend)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
              output_final_state: bool = False, use_qk_l2norm: bool = False, backend: registry.BackendArg = None):
    """KDA token by token from ``initial_state`` (decode: usually T = 1). Returns ``(o [B, T, H, V],
    final_state [B, H, K, V] or None)``, the state fp32 (fp64 for fp64 inputs)."""
    _validate_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm)
    return registry.call("kda_recurrent", q, k, v, g, beta, scale=None if scale is None else float(scale),
                         initial_state=initial_state, output_final_state=output_final_state,
                         use_qk_l2norm=use_qk_l2norm, backend=backend)


def _validate_conv(x, weight, bias, conv_state, activation, sizes: dict[str, int]) -> None:
    _checks.tensor("weight", weight, dims=("D", "W"), sizes=sizes, legend="[D, W]")
    if sizes["W"] < 1:
        raise ValueError(f"weight: expected a conv width W >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias, dims=("D",), sizes=sizes, legend="[D]")
    if conv_state is not None:
        _checks.tensor("conv_state", conv_state, dims=("B", sizes["W"] - 1, "D"), sizes=sizes, legend="[B, W - 1, D]")
    _checks.same_device(x=x, weight=weight, bias=bias, conv_state=conv_state)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(ACTIVATIONS)}, got {activation!r}")


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                conv_state: Optional[torch.Tensor] = None, activation: Optional[str] = "silu",
                output_final_state: bool = False, backend: registry.BackendArg = None):
    """The short causal depthwise conv over ``x [B, T, D]`` (``weight [D, W]``), continuing from ``conv_state``
    ``[B, W - 1, D]`` (None: a fresh sequence). Returns ``(out [B, T, D], new state or None)``."""
    sizes: dict[str, int] = {}
    _checks.tensor("x", x, dims=("B", "T", "D"), sizes=sizes, legend="[B, T, D]")
    _validate_conv(x, weight, bias, conv_state, activation, sizes)
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state: expected a bool, got {type(output_final_state).__name__}")
    return registry.call("kda_causal_conv", x, weight, bias, conv_state=conv_state, activation=activation,
                         output_final_state=output_final_state, backend=backend)


def causal_conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, *, activation: Optional[str] = "silu",
                       backend: registry.BackendArg = None):
    """One decode step of the conv: ``x [B, D]`` against ``conv_state [B, W - 1, D]``. Returns
    ``(out [B, D], new state [B, W - 1, D])`` (the state argument is not modified)."""
    sizes: dict[str, int] = {}
    _checks.tensor("x", x, dims=("B", "D"), sizes=sizes, legend="[B, D]")
    if conv_state is None:
        raise TypeError("conv_state: expected a torch.Tensor [B, W - 1, D] (a decode step continues a state), "
                        "got None")
    _validate_conv(x, weight, bias, conv_state, activation, sizes)
    return registry.call("kda_causal_conv_update", x, conv_state, weight, bias, activation=activation,
                         backend=backend)
