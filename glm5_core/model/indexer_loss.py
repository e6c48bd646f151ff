"""Training signals of the DSA indexer: the KL to the main attention, and top-k recall.

Legend: B batch, T queries, S key slots, H attention heads, K top-k width, C kv_lora_rank, Dr rope dims.

Target ``p[b,t,:]``: the main attention probabilities summed over heads and L1-normalised (detached).
Dense stage:  KL(p || softmax(I)) over every causal key.
Sparse stage: KL(p_S || softmax(I_S)) over the selected keys S. Its target p_S (``loss.indexer_kl_target``):
  "selected" (default): each head's softmax over the selected keys only (the sparse attention the stage runs),
      summed over heads and L1-normalised, as Megatron-LM's DSA trains it (``compute_dsa_indexer_loss`` with
      ``sparse_loss=True`` in megatron/core/transformer/experimental_attention_variant/dsa.py: the non-selected keys
      are masked to -inf before the per-head softmax). O(T K H D): no pass over the other keys.
  "causal": the dense p (each head's softmax over every causal key) at the selected keys, renormalised over them
      (what glm5-core trained with before; its normaliser needs a pass over all T x S scores of every head).
Recall:       the share of the DENSE p's mass that falls on the selected keys (needs the "causal" normaliser: in
              the sparse stage with the "selected" target it costs an extra pass, so it runs only when asked).
Each is averaged over the B*T queries.

The sparse stage needs p and the indexer scores at the selected keys only: ``selected_attention_target`` (the op
``dsa_selected_attention_target``) gives p there without a [B, T, S] tensor, and
``glm5_core.ops.dsa.selected_index_scores`` gives the scores at the selected keys with their gradient.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from glm5_core import registry
from glm5_core.ops import dsa
from glm5_core.ops.mla import absorb_query, causal_mask
from glm5_core.ops.selected_attention_target import NORMALISERS

StartPos = Union[int, torch.Tensor]
KL_TARGETS = NORMALISERS  # the sparse stage's KL target: "selected" | "causal" (the op's normaliser)


@torch.no_grad()
def attention_target(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     w_uk: torch.Tensor, *, scale: float, start_pos: StartPos) -> torch.Tensor:
    """p [B, T, S] (fp32, fp64 for fp64 inputs): head-summed, L1-normalised main attention, no gradient."""
    compute = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
    q_nope, q_pe, c_kv, k_pe, w_uk = (t.to(compute) for t in (q_nope, q_pe, c_kv, k_pe, w_uk))
    B, T = q_nope.shape[:2]
    S = c_kv.shape[1]
    q_lat = absorb_query(q_nope, w_uk)  # [B, T, H, C]
    scores = torch.einsum("bthc,bsc->bhts", q_lat, c_kv)  # [B, H, T, S]
    scores += torch.einsum("bthr,bsr->bhts", q_pe, k_pe)
    visible = causal_mask(start_pos, B, T, S, q_nope.device)  # [B, T, S]
    # in place on the fresh [B, H, T, S] scores (no gradient here): the same values, no temporaries of that size
    probs = torch.softmax(scores.mul_(scale).masked_fill_(~visible.unsqueeze(1), float("-inf")), dim=-1)
    summed = probs.sum(dim=1)  # [B, T, S]
    return summed.div_(summed.sum(dim=-1, keepdim=True))


def selected_attention_target(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                              w_uk: torch.Tensor, topk_idx: torch.Tensor, *, scale: float,
                              start_pos: StartPos, k_nope: Optional[torch.Tensor] = None,
                              normaliser: str = "selected", backend: registry.BackendArg = None) -> torch.Tensor:
    """The target at topk_idx [B, T, K] (0 at the -1 slots), detached, with no [B, T, S] tensor: the op
    ``glm5_core.ops.dsa.selected_attention_target``. ``normaliser`` "selected": each head's softmax over the
    selected keys, head-summed and L1-normalised (the cpu kernel needs the selected keys only); "causal":
    attention_target(...) gathered at topk_idx (the cpu kernel needs each head's log-sum-exp over every key too).
    ``k_nope`` [B, S, H, Dn]: the expanded keys when the caller already has them (else computed from c_kv and
    w_uk)."""
    return dsa.selected_attention_target(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, scale=scale, start_pos=start_pos,
                                         k_nope=k_nope, normaliser=normaliser, backend=backend)


def _kl(target: torch.Tensor, log_q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """mean over queries of sum_s target * (log target - log_q), over the kept entries only.

    The other entries (target 0, log_q -inf there) are NaN before the ``where`` drops them; their gradient is the
    ``where``'s 0 times target, 0 (target is finite), as from masking log_q first."""
    entropy_term = torch.xlogy(target, target)  # 0 where target == 0
    per_entry = torch.where(keep, entropy_term - target * log_q, 0.0)
    return per_entry.sum(-1).mean()


def dense_kl(target: torch.Tensor, index_scores: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(I)) over causal keys; index_scores [B, T, S] with -inf where not causal."""
    keep = torch.isfinite(index_scores)
    log_q = torch.log_softmax(index_scores.to(target.dtype), dim=-1)
    return _kl(target, log_q, keep)


def sparse_kl(target: torch.Tensor, index_scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """The KL restricted to the selected keys topk_idx [B, T, K] (-1 = none), from the dense p and scores."""
    keep = topk_idx >= 0  # [B, T, K]
    rows = topk_idx.clamp(min=0).long()
    selected_scores = index_scores.gather(-1, rows).masked_fill(~keep, float("-inf"))  # [B, T, K]
    selected_p = target.gather(-1, rows).masked_fill(~keep, 0.0)  # [B, T, K]
    return selected_kl(selected_p, selected_scores, topk_idx)


def selected_kl(selected_target: torch.Tensor, selected_scores: torch.Tensor,
                topk_idx: torch.Tensor) -> torch.Tensor:
    """sparse_kl from p and the indexer scores at the selected keys, both [B, T, K] (p 0 and scores -inf at
    the -1 slots of topk_idx)."""
    keep = topk_idx >= 0  # [B, T, K]
    dtype = selected_target.dtype
    selected_p = selected_target / selected_target.sum(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return _kl(selected_p, torch.log_softmax(selected_scores.to(dtype), dim=-1), keep)


@torch.no_grad()
def topk_recall(target: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Mean over queries of the target mass on the selected keys."""
    keep = topk_idx >= 0
    mass = target.gather(-1, topk_idx.clamp(min=0).long()).masked_fill(~keep, 0.0)  # [B, T, K]
    return selected_recall(mass)


@torch.no_grad()
def selected_recall(selected_target: torch.Tensor) -> torch.Tensor:
    """topk_recall from p at the selected keys [B, T, K] (0 at the -1 slots)."""
    return selected_target.sum(-1).mean()
