"""cpu backend kernel for ``dsa_selected_attention_target``: the sparse stage's indexer-KL target.

Legend as in ``glm5_core.ops.selected_attention_target`` (Hm written H here); D = Dn + Dr.

The target p[b,t,j] = (1/H) sum_h exp(scale * score_h[t, i_j] - lse_h[t]), lse_h the log-sum-exp of head h over
the keys its softmax normalises over (``normaliser``):
  "selected": the row's valid selected keys. One pass: the native kernel (csrc/cpu_selected_attention_target.cpp,
     given an empty lse) scores the K selected keys of every head, takes each head's max and sum of exponentials
     over them, and sums the heads' probabilities: O(T K H D), nothing over the other keys.
  "causal": every causal key (each head's probabilities sum to 1, so the head sum sums to H): only lse [B, T, H]
     needs every key, the rest needs the K selected ones. Two passes:
  1. lse from torch's fused CPU flash-attention kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``: it
     returns the log-sum-exp, natural log, scale applied), with q = [q_nope, q_pe] and k = [k_nope, k_pe] per head
     (one score per head is q . k). It never holds probabilities beyond its own tiles. Query t of row b sees the
     keys s <= start[b] + t: the flash kernel's causal mask over the keys [start, start + T), plus (start > 0) an
     unmasked pass over the keys [0, start) merged with logaddexp; rows with different starts go one at a time.
     Its value output is a by-product (the keys stand in for the values).
  2. the native kernel at the selected keys: O(T K H D).
Both are deterministic: the result is bitwise repeatable whatever the thread count.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks
from glm5_core.ops.selected_attention_target import expanded_keys

FLASH_OP = "_scaled_dot_product_flash_attention_for_cpu"


def _lse(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Per-head log-sum-exp [B, H, T] of scale * q . k over the keys of k, q [B, H, T, D], k [B, H, S', D]."""
    flash = getattr(torch.ops.aten, FLASH_OP)
    return flash(q, k, k, 0.0, causal, scale=scale)[1]


def _starts(start_pos, batch: int) -> list[int]:
    if isinstance(start_pos, torch.Tensor):
        return [int(s) for s in start_pos.tolist()]
    return [int(start_pos)] * batch


def dense_lse(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, *, scale: float,
              start_pos) -> torch.Tensor:
    """lse [B, T, H] of every head over its causal keys (all inputs in one compute dtype)."""
    B, T, H, _ = q_nope.shape
    S, Dr = k_pe.shape[1], k_pe.shape[2]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, S, H, Dr)], dim=-1).transpose(1, 2)  # [B, H, S, D]
    starts = _starts(start_pos, B)
    groups = [(0, B, starts[0])] if len(set(starts)) == 1 else [(b, b + 1, starts[b]) for b in range(B)]
    parts = []
    for b0, b1, start in groups:
        lse = _lse(q[b0:b1], k[b0:b1, :, start:start + T], scale, causal=True)  # [b, H, T]
        if start > 0:  # the keys before the first query: visible to every query
            lse = torch.logaddexp(lse, _lse(q[b0:b1], k[b0:b1, :, :start], scale, causal=False))
        parts.append(lse)
    lse = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # [B, H, T]
    return lse.transpose(1, 2).contiguous()  # [B, T, H]


@torch.no_grad()
def selected_attention_target(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, *, scale: float, start_pos,
                              k_nope: Optional[torch.Tensor] = None, normaliser: str = "selected") -> torch.Tensor:
    """[B, T, K] in the compute dtype: the reference's contract (detached), in O(T K H D) time ("selected"; "causal":
    O(T S H D)) and O(T K) memory."""
    ct = _checks.compute_dtype(q_nope.dtype)
    q_nope, q_pe, k_pe = (t.detach().to(ct) for t in (q_nope, q_pe, k_pe))
    if k_nope is None:
        k_nope = expanded_keys(c_kv.detach().to(ct), w_uk.detach().to(ct))  # [B, S, H, Dn]
    else:
        k_nope = k_nope.detach().to(ct)
    if normaliser == "causal":
        lse = dense_lse(q_nope, q_pe, k_nope, k_pe, scale=scale, start_pos=start_pos)  # [B, T, H]
    else:
        lse = q_nope.new_empty(0)  # the kernel normalises each head over the selected keys
    start = torch.tensor(_starts(start_pos, q_nope.shape[0]), dtype=torch.int64)  # [B]
    return torch.ops.glm5_cpu.selected_attention_target(q_nope, q_pe, k_nope, k_pe, lse, topk_idx, start,
                                                        float(scale))


def _supports(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, *, scale: float, start_pos,
              k_nope: Optional[torch.Tensor] = None, normaliser: str = "selected") -> tuple[bool, str]:
    devices = {t.device.type for t in (q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, k_nope, start_pos)
               if isinstance(t, torch.Tensor)}
    if devices != {"cpu"}:
        return False, f"native CPU kernels need CPU tensors, got {sorted(devices)}"
    if normaliser == "causal" and not hasattr(torch.ops.aten, FLASH_OP):
        return False, f"this torch ({torch.__version__}) has no aten::{FLASH_OP} (the dense log-sum-exp pass)"
    return True, ""


KERNELS: Mapping[str, Kernel] = {
    "dsa_selected_attention_target": Kernel(selected_attention_target, supports=_supports),
}
