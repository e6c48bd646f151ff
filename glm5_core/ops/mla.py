"""Multi-head latent attention (MLA): prefill in the expanded form, decode in the weight-absorbed form.

The ops of this family (``OPS`` declares them): ``mla_prefill`` (entry point ``prefill``, reference
``prefill_reference``) and ``mla_decode`` (``decode``, ``decode_reference``).

Legend (sizes):
  B batch, T queries, S key slots (latent cache length), H heads,
  Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim, C = kv_lora_rank (the latent width).

Weights: ``w_uk [H, Dn, C]`` and ``w_uv [H, Dv, C]`` are the two halves of ``kv_b_proj`` viewed as
``[H, Dn + Dv, C]``. Positions: query ``t`` of row ``b`` is at absolute position ``start_pos[b] + t`` and
sees keys ``0 .. start_pos[b] + t`` (causal). Scores are ``scale * (q_nope . k_nope + q_pe . k_pe)``.

Expanded (prefill):  k_nope = c_kv @ W_UK^T, v = c_kv @ W_UV^T per head; ordinary attention.
Absorbed (decode):   q_lat = q_nope @ W_UK (C wide); score = q_lat . c_kv + q_pe . k_pe;
                     out = (p @ c_kv) @ W_UV^T. The cache is never expanded.
The two are the same function of their inputs; the conformance suite checks they agree.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from glm5_core import registry
from glm5_core.ops import _checks
from glm5_core.opspec import OpSpec

StartPos = Union[int, torch.Tensor]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat[b,t,h,:] = q_nope[b,t,h,:] @ w_uk[h]: [B,T,H,Dn] x [H,Dn,C] -> [B,T,H,C]."""
    return torch.einsum("bthd,hdc->bthc", q_nope, w_uk)


def project_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out[b,t,h,:] = w_uv[h] @ o_lat[b,t,h,:]: [B,T,H,C] x [H,Dv,C] -> [B,T,H,Dv]."""
    return torch.einsum("bthc,hvc->bthv", o_lat, w_uv)


def causal_mask(start_pos: StartPos, batch: int, num_queries: int, num_keys: int,
                device: torch.device) -> torch.Tensor:
    """True where key s is visible to query t: bool [B, T, S]."""
    pos = _checks.query_positions(start_pos, batch, num_queries, device)  # [B, T]
    keys = torch.arange(num_keys, device=device)  # [S]
    return keys.view(1, 1, num_keys) <= pos.unsqueeze(-1)  # [B, T, S]


def validate_mla_tensors(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale) -> dict[str, int]:
    """Shapes, dtypes, devices and scale of the six MLA inputs (shared with DSA's sparse attention, and with its
    indexer-KL target, which has no values: ``w_uv`` None)."""
    sizes: dict[str, int] = {}
    _checks.tensor("q_nope", q_nope, dims=("B", "T", "H", "Dn"), sizes=sizes, legend="[B, T, H, Dn]")
    _checks.tensor("q_pe", q_pe, dims=("B", "T", "H", "Dr"), sizes=sizes, legend="[B, T, H, Dr]")
    _checks.tensor("c_kv", c_kv, dims=("B", "S", "C"), sizes=sizes, legend="[B, S, C]")
    _checks.tensor("k_pe", k_pe, dims=("B", "S", "Dr"), sizes=sizes, legend="[B, S, Dr]")
    _checks.tensor("w_uk", w_uk, dims=("H", "Dn", "C"), sizes=sizes, legend="[H, Dn, C]")
    floating = dict(q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w_uk=w_uk)
    if w_uv is not None:
        _checks.tensor("w_uv", w_uv, dims=("H", None, "C"), sizes=sizes, legend="[H, Dv, C]")
        floating["w_uv"] = w_uv
    _checks.same_dtype(**floating)
    _checks.same_device(**floating)
    _checks.positive_float("scale", scale)
    return sizes


def _validate(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, start_pos) -> dict[str, int]:
    sizes = validate_mla_tensors(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale)
    device = q_nope.device
    if sizes["S"] < 1 or sizes["T"] < 1:
        raise ValueError(f"c_kv / q_nope: expected at least one key and one query, got S={sizes['S']}, T={sizes['T']}")
    _checks.start_positions(start_pos, sizes["B"], sizes["T"], sizes["S"], device)
    return sizes


def _softmax_attend(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax over the last dim; scores [B,H,T,S], mask [B,T,S]."""
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return torch.softmax(scores, dim=-1)


def prefill_reference(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale: float, start_pos: StartPos = 0):
    """Expanded-form MLA. Returns [B, T, H, Dv] in the input dtype."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (t.to(ct) for t in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    B, T = q_nope.shape[:2]
    S = c_kv.shape[1]
    k_nope = torch.einsum("bsc,hdc->bshd", c_kv, w_uk)  # [B, S, H, Dn]
    value = torch.einsum("bsc,hvc->bshv", c_kv, w_uv)  # [B, S, H, Dv]
    scores = torch.einsum("bthd,bshd->bhts", q_nope, k_nope)  # [B, H, T, S]
    scores = scores + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)  # shared rope key
    probs = _softmax_attend(scores * scale, causal_mask(start_pos, B, T, S, q_nope.device))  # [B, H, T, S]
    out = torch.einsum("bhts,bshv->bthv", probs, value)  # [B, T, H, Dv]
    return out.to(out_dtype)


def decode_reference(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale: float, start_pos: StartPos):
    """Absorbed-form MLA against the latent cache. Returns [B, T, H, Dv] in the input dtype."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (t.to(ct) for t in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    B, T = q_nope.shape[:2]
    S = c_kv.shape[1]
    q_lat = absorb_query(q_nope, w_uk)  # [B, T, H, C]
    scores = torch.einsum("bthc,bsc->bhts", q_lat, c_kv)  # [B, H, T, S]
    scores = scores + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    probs = _softmax_attend(scores * scale, causal_mask(start_pos, B, T, S, q_nope.device))  # [B, H, T, S]
    o_lat = torch.einsum("bhts,bsc->bthc", probs, c_kv)  # [B, T, H, C]
    return project_output(o_lat, w_uv).to(out_dtype)  # [B, T, H, Dv]


OPS = (
    OpSpec("mla_prefill", prefill_reference, family="mla", differentiable=True),
    OpSpec("mla_decode", decode_reference, family="mla"),
)


def prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
            w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: float, start_pos: StartPos = 0,
            backend: registry.BackendArg = None) -> torch.Tensor:
    """Causal MLA over ``T`` new queries and ``S`` key slots, expanded form. Returns [B, T, H, Dv]."""
    _validate(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, start_pos)
    return registry.call("mla_prefill", q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=float(scale),
                         start_pos=start_pos, backend=backend)


def decode(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
           w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: float, start_pos: Optional[StartPos] = None,
           backend: registry.BackendArg = None) -> torch.Tensor:
    """MLA of ``T`` (usually 1) new queries against the latent cache, absorbed form. Returns [B, T, H, Dv].

    ``start_pos`` defaults to ``S - T`` (the queries are the last ``T`` cache slots); pass an int tensor
    ``[B]`` for ragged batches (slots past a row's last query are ignored)."""
    if start_pos is None and isinstance(c_kv, torch.Tensor) and isinstance(q_nope, torch.Tensor) \
            and c_kv.dim() == 3 and q_nope.dim() == 4:
        start_pos = c_kv.shape[1] - q_nope.shape[1]
    _validate(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, start_pos)
    return registry.call("mla_decode", q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=float(scale),
                         start_pos=start_pos, backend=backend)
