"""Reference of ``dsa_selected_attention_target``: the sparse stage's indexer-KL target at the selected keys only,
with no [B, T, S] tensor. No gradient: the target is detached (the indexer learns from it, the model does not).

Legend: B batch, T queries, S key slots, H attention heads, Dn / Dr nope / rope widths, C kv_lora_rank, K selected
keys per query, c a block of queries; score_h[t, s] = scale * (q_nope . k_nope + q_pe . k_pe) of head h.

Two normalisers (``normaliser``), each giving p[b,t,j] at the key i_j = topk_idx[b,t,j] (0 where i_j = -1 or the
key is past the query):

  "selected" (the sparse stage's default): each head's softmax over the row's valid SELECTED keys only,
      p[b,t,j] = (1/H) sum_h exp(score_h[t, i_j]) / sum_{valid j'} exp(score_h[t, i_j'])
    the sparse attention's own probabilities, head-summed and L1-normalised (each row sums to 1, or is all 0 when
    it has no valid key). Megatron-LM's DSA indexer loss with ``sparse_loss=True``
    (megatron/core/transformer/experimental_attention_variant/dsa.py, ``compute_dsa_indexer_loss``: the
    non-selected keys are masked to -inf before the per-head softmax; its fused path
    ``_compute_topk_target_chunk_sum`` normalises each head over the top-k keys only), which slime trains GLM-5
    with. It needs the selected keys' scores only: O(T K H D).
  "causal": the DENSE normaliser, each head's softmax over EVERY causal key,
      p[b,t,j] = (1/H) sum_h softmax_s(score_h[t, s])[i_j]
    the head-summed, L1-normalised main attention (``glm5_core.model.indexer_loss.attention_target``) gathered at
    the selected keys; its mass on them is the top-k recall. The normaliser needs a pass over all T x S scores.

Both go through blocks of ``QUERY_BLOCK`` queries: each builds its [B, H, c, S'] scores (S' the keys visible to its
last query), never [B, T, S]; "selected" gathers them at the selected keys. Scores take MLA's expanded form,
q_nope . (c_kv W_UK^T) + q_pe . k_pe (the absorbed form's values up to rounding).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from glm5_core.ops.mla import causal_mask

StartPos = Union[int, torch.Tensor]

QUERY_BLOCK = 256  # queries per block: [B, H, QUERY_BLOCK, S] scores at a time
NORMALISERS = ("selected", "causal")  # each head's softmax over the selected keys / over every causal key


def expanded_keys(c_kv: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """k_nope [B, S, H, Dn] = c_kv W_UK^T from the latent rows c_kv [B, S, C] and w_uk [H, Dn, C]."""
    return torch.einsum("bsc,hdc->bshd", c_kv, w_uk)


@torch.no_grad()
def selected_attention_target_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                                        k_pe: torch.Tensor, w_uk: torch.Tensor, topk_idx: torch.Tensor, *,
                                        scale: float, start_pos: StartPos,
                                        k_nope: Optional[torch.Tensor] = None,
                                        normaliser: str = "selected") -> torch.Tensor:
    """p at topk_idx [B, T, K] (-1 = none) in the compute dtype (fp32, fp64 for fp64 inputs), 0 at the -1 slots and
    at keys past the query; detached. ``k_nope`` [B, S, H, Dn]: the expanded keys when the caller already has them
    (else computed from c_kv and w_uk). ``normaliser``: "selected" or "causal" (module docstring)."""
    compute = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
    q_nope, q_pe, c_kv, k_pe, w_uk = (t.to(compute) for t in (q_nope, q_pe, c_kv, k_pe, w_uk))
    B, T = q_nope.shape[:2]
    S = c_kv.shape[1]
    if k_nope is None:
        k_nope = torch.einsum("bsc,hdc->bhsd", c_kv, w_uk)  # [B, H, S, Dn]
    else:
        k_nope = k_nope.detach().to(compute).transpose(1, 2)  # [B, S, H, Dn] -> [B, H, S, Dn]
    last_start = int(start_pos.max()) if isinstance(start_pos, torch.Tensor) else int(start_pos)
    blocks = []
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(T, t0 + QUERY_BLOCK)
        seen = min(S, last_start + t1)  # keys past every query of the block are invisible: not computed
        q_blk = q_nope[:, t0:t1].transpose(1, 2)  # [B, H, c, Dn]
        scores = torch.matmul(q_blk, k_nope[:, :, :seen].transpose(2, 3))  # [B, H, c, seen]
        scores = scores + torch.matmul(q_pe[:, t0:t1].transpose(1, 2), k_pe[:, :seen].unsqueeze(1).transpose(2, 3))
        visible = causal_mask(start_pos + t0, B, t1 - t0, seen, q_nope.device)  # [B, c, seen]; start: int or [B]
        idx = topk_idx[:, t0:t1].long()  # [B, c, K]
        unseen = (idx < 0) | (idx >= seen)  # no key, or a key past every query of the block (probability 0)
        if normaliser == "selected":
            blocks.append(_selected_softmax(scores * scale, visible, idx, unseen))
            continue
        probs = torch.softmax((scores * scale).masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1)
        summed = probs.sum(dim=1)  # [B, c, seen]
        target = summed / summed.sum(dim=-1, keepdim=True)
        blocks.append(target.gather(-1, idx.clamp(0, seen - 1)).masked_fill(unseen, 0.0))
    return torch.cat(blocks, dim=1)  # [B, T, K]


def _selected_softmax(scores: torch.Tensor, visible: torch.Tensor, idx: torch.Tensor,
                      unseen: torch.Tensor) -> torch.Tensor:
    """The "selected" target of one block [B, c, K]: each head's softmax over the block's scaled scores
    [B, H, c, seen] gathered at its valid selected keys idx [B, c, K], summed over the H heads and divided by H
    (zeros for a row with no valid key)."""
    H = scores.shape[1]
    rows = idx.clamp(0, scores.shape[-1] - 1)  # [B, c, K]
    valid = ~unseen & visible.gather(-1, rows)  # [B, c, K]: a key, visible to its query
    picked = scores.gather(-1, rows.unsqueeze(1).expand(-1, H, -1, -1))  # [B, H, c, K]
    probs = torch.softmax(picked.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)  # NaN on empty rows
    probs = probs.masked_fill(~valid.unsqueeze(1), 0.0)  # also zeroes an empty row's NaNs
    return probs.sum(dim=1) / H  # [B, c, K]
