"""Mixture-of-experts routing, dispatch / combine, SwiGLU grouped experts, aux-loss-free balancing.

The ops of this family (``OPS`` at the end declares them), each ``moe_<name>`` with entry point ``<name>`` and
reference ``<name>_reference``:

  moe_route          route            route_reference
  moe_dispatch       dispatch         dispatch_reference
  moe_combine        combine          combine_reference
  moe_experts        experts          experts_reference          (SwiGLU over expert-sorted rows)
  moe_fused_experts  fused_experts    fused_experts_reference    (composite: dispatch -> experts -> combine)

Legend (sizes): N tokens, E routed experts, G expert groups, K experts per token (top-k),
D hidden size, F expert FFN size, M = N * K routed token copies.

Routing contract (every backend):
  scores = sigmoid(logits) (or softmax); selection uses scores + bias (bias only for selection);
  with G > 1 groups a group scores as the sum of its top-2 selection scores and only the best
  ``topk_group`` groups stay eligible; the top-K experts are taken with ties to the LOWER expert id
  (and groups with ties to the lower group id); ids are int32 [N, K] in selection order; weights are
  the UNBIASED scores of the chosen experts, optionally renormalised to sum 1, times
  ``routed_scaling_factor``.

SwiGLU: silu(x Wg^T) * (x Wu^T); with ``swiglu_limit`` L (GLM-5.3, ``experts`` / ``fused_experts``) the gate is
clamped to <= L and the up projection to [-L, L] first, as transformers' ``Glm5NextTextExperts`` (``swiglu``); every
backend's kernel takes the limit (forward and backward), and a call without it is the unclamped call of before.

Dispatch sorts the M = N*K (token, slot) assignments by expert id, stably, so within an expert tokens
stay in token order (then slot order); ``sort_idx[m]`` is the flat assignment index ``n * K + j`` of
sorted row ``m`` and ``counts[e]`` the number of rows of expert ``e``. Combine is its deterministic
inverse: a gather, then a weighted sum over the K slots in slot order (no atomics).

``fused_experts`` is dispatch -> experts -> combine as one op (the routed MoE FFN of a layer). It is
a composite op: a backend without a fused kernel runs its own three kernels (its ``OpSpec`` in ``OPS``),
one with a fused kernel (cpu) skips materialising the [M, D] routed copy of the inputs.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from glm5_core import registry
from glm5_core.ops import _checks
from glm5_core.opspec import OpSpec

SCORE_FUNCS = ("sigmoid", "softmax")
RENORM_EPS = 1e-20


class _Sigmoid(torch.autograd.Function):
    """1 / (1 + exp(-x)) from exactly rounded elementwise ops and exp: unlike torch.sigmoid on CPU (whose
    vectorised body and scalar tail round differently), a value's score does not depend on the batch shape.

    The backward is s * (1 - s) from the saved output: differentiating the formula itself gives
    0 * exp(-x) = 0 * inf = NaN once exp(-x) overflows (x < -88.7 in fp32), even for unselected experts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        scores = 1.0 / (1.0 + torch.exp(-x))
        ctx.save_for_backward(scores)
        return scores

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (scores,) = ctx.saved_tensors
        return grad * scores * (1.0 - scores)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _Sigmoid.apply(x)


def _stable_desc_order(values: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last dim descending, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices


def route_reference(logits, bias, *, top_k: int, score_func: str = "sigmoid", n_group: int = 1,
                    topk_group: int = 1, renormalize: bool = True, routed_scaling_factor: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights fp32 [N, K], expert ids int32 [N, K])."""
    N, E = logits.shape
    ct = _checks.compute_dtype(logits.dtype)
    logits = logits.to(ct)
    scores = _sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)  # [N, E]
    select = scores if bias is None else scores + bias.to(ct)  # [N, E]
    if n_group > 1:
        per_group = E // n_group
        grouped = select.view(N, n_group, per_group)  # [N, G, E/G]
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [N, G]
        kept = _stable_desc_order(group_score)[:, :topk_group]  # [N, topk_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)  # [N, G]
        keep = keep.unsqueeze(-1).expand(N, n_group, per_group).reshape(N, E)  # [N, E]
        select = select.masked_fill(~keep, float("-inf"))
    ids = _stable_desc_order(select)[:, :top_k]  # [N, K]
    return _weights_at(scores, ids, renormalize, routed_scaling_factor), ids.to(torch.int32)


def _weights_at(scores: torch.Tensor, ids: torch.Tensor, renormalize: bool, routed_scaling_factor: float
                ) -> torch.Tensor:
    """The routing weights of experts ``ids`` [N, K] from the unbiased scores [N, E] (compute dtype)."""
    weights = scores.gather(1, ids.long())  # [N, K], unbiased
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
    weights = weights * routed_scaling_factor
    return weights.to(torch.float64 if scores.dtype == torch.float64 else torch.float32)


def route_weights(logits: torch.Tensor, expert_ids: torch.Tensor, *, score_func: str = "sigmoid",
                  renormalize: bool = True, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """Routing weights fp32 [N, K] of GIVEN experts (routing replay): the unbiased scores of ``expert_ids``
    [N, K] computed from ``logits`` [N, E], renormalised and scaled as :func:`route` does; no selection.

    Differentiable in ``logits``: the router learns through the replayed experts' weights (Megatron's R3 /
    slime's ``--use-rollout-routing-replay`` gather the scores at the replayed ids the same way). Pure torch on
    every backend (a gather and a sum). ``expert_ids`` must hold K distinct ids in ``[0, E)`` per row."""
    sizes: dict[str, int] = {}
    _checks.tensor("logits", logits, dims=("N", "E"), sizes=sizes, legend="[N, E]")
    _checks.tensor("expert_ids", expert_ids, dims=("N", "K"), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                   legend="[N, K] int32")
    _checks.same_device(logits=logits, expert_ids=expert_ids)
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    _checks.positive_float("routed_scaling_factor", routed_scaling_factor)
    _checks.index_range("expert_ids", expert_ids, 0, sizes["E"] - 1)
    ct = _checks.compute_dtype(logits.dtype)
    logits = logits.to(ct)
    scores = _sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, dim=-1)  # [N, E]
    return _weights_at(scores, expert_ids, renormalize, float(routed_scaling_factor))


def dispatch_reference(x, expert_ids, *, num_experts: int):
    """Returns (x_sorted [M, D], sort_idx int64 [M], counts int64 [E])."""
    N, K = expert_ids.shape
    flat = expert_ids.reshape(-1).to(torch.int64)  # [M], m = n * K + j
    sort_idx = torch.sort(flat, stable=True).indices  # [M]
    x_sorted = x[sort_idx // K]  # [M, D]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    return x_sorted, sort_idx, counts


def combine_reference(y_sorted, sort_idx, weights):
    """out[n] = sum_j weights[n, j] * y[row of (n, j)], summed in slot order. Returns [N, D].

    Defined for any in-range ``sort_idx``, not only dispatch's permutations (``combine`` refuses others only while
    value checks are on): the row of an assignment is the LAST sorted row naming it, and an assignment no row
    names reads row 0. A max is order-independent, so this is deterministic on every device, at the cost of the
    plain scatter it replaces (an ``empty`` inverse read uninitialised memory for such assignments)."""
    N, K = weights.shape
    D = y_sorted.shape[-1]
    if K == 0:  # no slots: the empty sum
        return y_sorted.new_zeros(N, D)
    ct = _checks.compute_dtype(y_sorted.dtype)
    M = sort_idx.numel()
    rows = torch.arange(M, device=sort_idx.device)
    inverse = torch.zeros(M, dtype=torch.int64, device=sort_idx.device).scatter_reduce_(
        0, sort_idx.long(), rows, reduce="amax")  # flat assignment -> sorted row
    y = y_sorted.to(ct)[inverse].view(N, K, D)  # [N, K, D]
    w = weights.to(ct)
    out = w[:, 0, None] * y[:, 0]
    for j in range(1, K):  # fixed slot order
        out = out + w[:, j, None] * y[:, j]
    return out.to(y_sorted.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """silu(gate) * up; with ``swiglu_limit`` L, GLM-5.3's clamped form as transformers' ``Glm5NextTextExperts.
    _apply_gate``: silu(gate.clamp(max=L)) * up.clamp(-L, L) (autograd gives the clamps' gradients: they pass
    where min <= value <= max, the ends included)."""
    if swiglu_limit is not None:
        gate = gate.clamp(min=None, max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def experts_reference(x_sorted, counts, w_gate, w_up, w_down, *, swiglu_limit: Optional[float] = None):
    """Per expert e, over its contiguous rows: swiglu(x Wg^T, x Wu^T, swiglu_limit) Wd^T. Returns [M, D]."""
    ct = _checks.compute_dtype(x_sorted.dtype)
    outputs = []
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        xe = x_sorted[start:start + n].to(ct)  # [n, D]
        hidden = swiglu(xe @ w_gate[e].to(ct).T, xe @ w_up[e].to(ct).T, swiglu_limit)  # [n, F]
        outputs.append(hidden @ w_down[e].to(ct).T)  # [n, D]
        start += n
    if not outputs:
        return x_sorted.new_zeros(x_sorted.shape)
    return torch.cat(outputs).to(x_sorted.dtype)


ROW_BLOCK = 16  # rows per GEMM of experts_batch_invariant: every GEMM there is [ROW_BLOCK, D] x [D, F] (or F x D)


def _blocked_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, d_in] @ w.T ([d_out, d_in]) as fixed-shape GEMMs of ROW_BLOCK rows (the last block zero-padded):
    every call has the same shape, so a row's result does not depend on n or on the other rows. Returns
    [n, d_out]."""
    n = x.shape[0]
    if n == 0:
        return x @ w.T  # [0, d_out], still a function of w (its gradient is zeros)
    blocks = -(-n // ROW_BLOCK)
    padded = torch.cat([x, x.new_zeros(blocks * ROW_BLOCK - n, x.shape[1])]) if blocks * ROW_BLOCK != n else x
    wt = w.T
    return torch.cat([padded[b * ROW_BLOCK:(b + 1) * ROW_BLOCK] @ wt for b in range(blocks)])[:n]


def experts_batch_invariant(x_sorted, counts, w_gate, w_up, w_down, *, swiglu_limit: Optional[float] = None):
    """:func:`experts_reference`'s function (SwiGLU per expert over its contiguous rows, in fp32 / fp64), computed
    so that each row's result is bitwise the same whatever other rows share the call: every GEMM is a fixed
    [ROW_BLOCK, ...] block (BLAS picks other kernels and reduction orders for other row counts: measured on
    MKL 2024.2, ``x[:n] @ W.T`` changes a row's bits for n from 1 to 100), and SiLU is ``h * sigmoid(h)`` from
    exactly rounded elementwise ops (``_Sigmoid``), whose bits do not depend on where a value sits in the
    tensor. Expert parallelism needs this: an expert's GEMM sees the rows of every rank of the group, without
    EP only those of its own rank. Differentiable (torch ops); every expert's weights stay in the graph, an
    expert with no rows included (its gradient is zeros). ``swiglu_limit``: GLM-5.3's clamp, as in :func:`swiglu`
    (the clamps are elementwise: batch-invariant too). Any device; returns [M, D] in x_sorted's dtype."""
    ct = _checks.compute_dtype(x_sorted.dtype)
    outputs = []
    start = 0
    for e, n in enumerate(counts.tolist()):
        xe = x_sorted[start:start + n].to(ct)  # [n, D]
        gate = _blocked_linear(xe, w_gate[e].to(ct))  # [n, F]
        up = _blocked_linear(xe, w_up[e].to(ct))  # [n, F]
        if swiglu_limit is not None:
            gate = gate.clamp(min=None, max=swiglu_limit)
            up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        hidden = gate * _sigmoid(gate) * up  # [n, F]
        outputs.append(_blocked_linear(hidden, w_down[e].to(ct)))  # [n, D]
        start += n
    if not outputs:
        return x_sorted.new_zeros(x_sorted.shape)
    return torch.cat(outputs).to(x_sorted.dtype)


def fused_experts_reference(x, weights, expert_ids, w_gate, w_up, w_down, *, swiglu_limit: Optional[float] = None):
    """The routed FFN: combine(experts(dispatch(x)), weights). Returns [N, D] in x's dtype."""
    x_sorted, sort_idx, counts = dispatch_reference(x, expert_ids, num_experts=w_gate.shape[0])
    y_sorted = experts_reference(x_sorted, counts, w_gate, w_up, w_down, swiglu_limit=swiglu_limit)
    return combine_reference(y_sorted, sort_idx, weights)


def _limit_kwargs(swiglu_limit: Optional[float]) -> dict:
    """``swiglu_limit`` goes to the kernels only when set: a call without it is the call of before the clamp
    (every kernel's unclamped path, bit for bit)."""
    return {} if swiglu_limit is None else {"swiglu_limit": swiglu_limit}


def fused_experts_composite(x, weights, expert_ids, w_gate, w_up, w_down, *, backend: str,
                            swiglu_limit: Optional[float] = None):
    """``fused_experts`` on a backend without a fused kernel: its dispatch, experts and combine kernels
    (each with its own reference fallback)."""
    x_sorted, sort_idx, counts = registry.call("moe_dispatch", x, expert_ids, num_experts=w_gate.shape[0],
                                               backend=backend)
    y_sorted = registry.call("moe_experts", x_sorted, counts, w_gate, w_up, w_down, backend=backend,
                             **_limit_kwargs(swiglu_limit))
    return registry.call("moe_combine", y_sorted, sort_idx, weights, backend=backend)


OPS = (
    OpSpec("moe_route", route_reference, family="moe", differentiable=True),
    OpSpec("moe_dispatch", dispatch_reference, family="moe", differentiable=True),
    OpSpec("moe_combine", combine_reference, family="moe", differentiable=True),
    OpSpec("moe_experts", experts_reference, family="moe", differentiable=True),
    OpSpec("moe_fused_experts", fused_experts_reference, family="moe", differentiable=True,
           composite=fused_experts_composite, parts=("moe_dispatch", "moe_experts", "moe_combine")),
)


def route(logits: torch.Tensor, bias: Optional[torch.Tensor] = None, *, top_k: int, score_func: str = "sigmoid",
          n_group: int = 1, topk_group: int = 1, renormalize: bool = True, routed_scaling_factor: float = 1.0,
          backend: registry.BackendArg = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Select ``top_k`` experts per token. Returns (weights fp32 [N, K], ids int32 [N, K])."""
    sizes: dict[str, int] = {}
    _checks.tensor("logits", logits, dims=("N", "E"), sizes=sizes, legend="[N, E]")
    if bias is not None:
        _checks.tensor("bias", bias, dims=("E",), sizes=sizes, legend="[E]")
        _checks.same_device(logits=logits, bias=bias)
        _checks.finite("bias", bias)
    _checks.finite("logits", logits)
    E = sizes["E"]
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
    _checks.positive_int("n_group", n_group)
    if E % n_group:
        raise ValueError(f"n_group: expected a divisor of the expert count E={E}, got {n_group}")
    _checks.positive_int("topk_group", topk_group)
    if topk_group > n_group:
        raise ValueError(f"topk_group: expected <= n_group={n_group}, got {topk_group}")
    _checks.positive_int("top_k", top_k)
    eligible = (E // n_group) * topk_group
    if top_k > eligible:
        raise ValueError(f"top_k: expected <= experts in the kept groups ({eligible}), got {top_k}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    _checks.positive_float("routed_scaling_factor", routed_scaling_factor)
    return registry.call("moe_route", logits, bias, top_k=top_k, score_func=score_func, n_group=n_group,
                         topk_group=topk_group, renormalize=renormalize,
                         routed_scaling_factor=float(routed_scaling_factor), backend=backend)


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int,
             backend: registry.BackendArg = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token copies by expert. Returns (x_sorted [N*K, D], sort_idx int64 [N*K], counts int64 [E])."""
    sizes: dict[str, int] = {}
    _checks.tensor("x", x, dims=("N", "D"), sizes=sizes, legend="[N, D]")
    _checks.tensor("expert_ids", expert_ids, dims=("N", "K"), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                   legend="[N, K] int32")
    _checks.same_device(x=x, expert_ids=expert_ids)
    _checks.positive_int("num_experts", num_experts)
    _checks.allocation("num_experts", (num_experts,), torch.int64, x.device, legend="the counts [E]")
    _checks.index_range("expert_ids", expert_ids, 0, num_experts - 1)
    return registry.call("moe_dispatch", x, expert_ids, num_experts=num_experts, backend=backend)


def combine(y_sorted: torch.Tensor, sort_idx: torch.Tensor, weights: torch.Tensor, *,
            backend: registry.BackendArg = None) -> torch.Tensor:
    """Weighted sum of each token's expert outputs (inverse of ``dispatch``). Returns [N, D]."""
    sizes: dict[str, int] = {}
    _checks.tensor("weights", weights, dims=("N", "K"), sizes=sizes, legend="[N, K]")
    _checks.tensor("y_sorted", y_sorted, dims=(sizes["N"] * sizes["K"], None), legend="[N*K, D]")
    _checks.tensor("sort_idx", sort_idx, dims=(sizes["N"] * sizes["K"],), dtypes=_checks.INDEX_DTYPES,
                   legend="[N*K] int64")
    _checks.same_device(y_sorted=y_sorted, sort_idx=sort_idx, weights=weights)
    M = sizes["N"] * sizes["K"]
    _checks.index_range("sort_idx", sort_idx, 0, M - 1)
    if _checks.value_checks_enabled() and M and not bool((torch.bincount(sort_idx.long(), minlength=M) == 1).all()):
        raise ValueError("sort_idx: expected a permutation of 0..N*K-1 (as returned by dispatch), got repeated entries")
    return registry.call("moe_combine", y_sorted, sort_idx, weights, backend=backend)


def _check_limit(swiglu_limit) -> Optional[float]:
    return None if swiglu_limit is None else _checks.positive_float("swiglu_limit", swiglu_limit)


def experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor, *, swiglu_limit: Optional[float] = None,
            backend: registry.BackendArg = None) -> torch.Tensor:
    """SwiGLU experts over expert-sorted rows (``counts[e]`` rows each). Returns [M, D]. ``swiglu_limit`` L > 0:
    the clamped SwiGLU of GLM-5.3 (see :func:`swiglu`); None (the default) the plain one."""
    sizes: dict[str, int] = {}
    _checks.tensor("x_sorted", x_sorted, dims=("M", "D"), sizes=sizes, legend="[M, D]")
    _checks.tensor("counts", counts, dims=("E",), dtypes=_checks.INDEX_DTYPES, sizes=sizes, legend="[E] int64")
    _checks.tensor("w_gate", w_gate, dims=("E", "F", "D"), sizes=sizes, legend="[E, F, D]")
    _checks.tensor("w_up", w_up, dims=("E", "F", "D"), sizes=sizes, legend="[E, F, D]")
    _checks.tensor("w_down", w_down, dims=("E", "D", "F"), sizes=sizes, legend="[E, D, F]")
    _checks.same_dtype(x_sorted=x_sorted, w_gate=w_gate, w_up=w_up, w_down=w_down)
    _checks.same_device(x_sorted=x_sorted, counts=counts, w_gate=w_gate, w_up=w_up, w_down=w_down)
    if _checks.value_checks_enabled() and counts.numel() and (int(counts.min()) < 0 or int(counts.sum()) != sizes["M"]):
        raise ValueError(f"counts: expected non-negative counts summing to M={sizes['M']}, "
                         f"got sum {int(counts.sum())}, min {int(counts.min())}")
    swiglu_limit = _check_limit(swiglu_limit)
    return registry.call("moe_experts", x_sorted, counts, w_gate, w_up, w_down, backend=backend,
                         **_limit_kwargs(swiglu_limit))


def fused_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, w_gate: torch.Tensor,
                  w_up: torch.Tensor, w_down: torch.Tensor, *, swiglu_limit: Optional[float] = None,
                  backend: registry.BackendArg = None) -> torch.Tensor:
    """The routed experts of a MoE layer: every token through its K experts (SwiGLU, clamped at ``swiglu_limit``
    when given), weighted and summed in slot order. Equals ``combine(experts(dispatch(x)), weights)``. Returns
    [N, D]."""
    sizes: dict[str, int] = {}
    _checks.tensor("x", x, dims=("N", "D"), sizes=sizes, legend="[N, D]")
    _checks.tensor("weights", weights, dims=("N", "K"), sizes=sizes, legend="[N, K]")
    _checks.tensor("expert_ids", expert_ids, dims=("N", "K"), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                   legend="[N, K] int32")
    _checks.tensor("w_gate", w_gate, dims=("E", "F", "D"), sizes=sizes, legend="[E, F, D]")
    _checks.tensor("w_up", w_up, dims=("E", "F", "D"), sizes=sizes, legend="[E, F, D]")
    _checks.tensor("w_down", w_down, dims=("E", "D", "F"), sizes=sizes, legend="[E, D, F]")
    _checks.same_dtype(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    _checks.same_device(x=x, weights=weights, expert_ids=expert_ids, w_gate=w_gate, w_up=w_up, w_down=w_down)
    _checks.index_range("expert_ids", expert_ids, 0, sizes["E"] - 1)
    swiglu_limit = _check_limit(swiglu_limit)
    return registry.call("moe_fused_experts", x, weights, expert_ids, w_gate, w_up, w_down, backend=backend,
                         **_limit_kwargs(swiglu_limit))


def grouped_swiglu(*args, **kwargs) -> torch.Tensor:
    """Deprecated name of :func:`experts` (the op ``moe_experts``)."""
    warnings.warn("moe.grouped_swiglu is deprecated: call moe.experts (the op moe_experts)", DeprecationWarning,
                  stacklevel=2)
    return experts(*args, **kwargs)


def grouped_swiglu_reference(*args, **kwargs) -> torch.Tensor:
    """Deprecated name of :func:`experts_reference`."""
    warnings.warn("moe.grouped_swiglu_reference is deprecated: call moe.experts_reference", DeprecationWarning,
                  stacklevel=2)
    return experts_reference(*args, **kwargs)


def update_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """Aux-loss-free balancing step: bias + gamma * sign(mean(load) - load). Returns a new [E] tensor."""
    sizes: dict[str, int] = {}
    _checks.tensor("bias", bias, dims=("E",), sizes=sizes, legend="[E]")
    _checks.tensor("load", load, dims=("E",), dtypes=_checks.FLOAT_DTYPES + _checks.INDEX_DTYPES, sizes=sizes,
                   legend="[E]")
    _checks.positive_float("gamma", gamma, allow_zero=True)
    load = load.to(_checks.compute_dtype(bias.dtype))  # counts stay exact: in bf16, 20000 and 20100 round together
    return bias + gamma * torch.sign(load.mean() - load).to(bias.dtype)
