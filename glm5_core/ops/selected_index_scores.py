"""Reference of ``dsa_selected_index_scores``: the lightning-indexer scores at the selected keys only,
differentiable, in O(T K) memory (the sparse stage's indexer KL).

Legend: B batch, T queries, S key slots, H indexer heads, D index_head_dim, K selected keys per query, c a block
of queries.

    I_sel[b,t,j] = sum_h w[b,t,h] * ReLU(q[b,t,h,:] . k[b, idx[b,t,j], :])   (-inf where idx = -1)

What the sparse stage's indexer KL needs: the dense score matrix [B, T, S] (and the [B, T, H, S] dot products its
autograd keeps) would cost O(T S) memory for K entries a row. Queries go through in blocks of ``QUERY_BLOCK``;
the backward recomputes each block's dot products instead of keeping them, so nothing [T, K, D]-sized lives
between the passes. Summation orders are fixed (no atomics): the gradients are repeatable.
"""
from __future__ import annotations

import torch

QUERY_BLOCK = 128  # queries per block: bounds the gathered keys [B, c, K, D] held at once


def _block_dots(q_blk: torch.Tensor, keys: torch.Tensor, rows_blk: torch.Tensor):
    """q_blk [B, c, H, D], keys [B, S, D], rows_blk int64 [B, c, K] (no -1) -> (gathered keys [B, c, K, D],
    dots [B, c, H, K])."""
    batch = torch.arange(keys.shape[0], device=keys.device).view(-1, 1, 1)  # [B, 1, 1]
    picked = keys[batch, rows_blk]  # [B, c, K, D]
    return picked, torch.einsum("bchd,bckd->bchk", q_blk, picked)


class _SelectedScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, w, rows):
        ctx.save_for_backward(q, keys, w, rows)
        T = q.shape[1]
        blocks = []
        for t0 in range(0, T, QUERY_BLOCK):
            t1 = min(T, t0 + QUERY_BLOCK)
            _, dots = _block_dots(q[:, t0:t1], keys, rows[:, t0:t1])  # [B, c, H, K]
            blocks.append(torch.einsum("bch,bchk->bck", w[:, t0:t1], torch.relu(dots)))  # [B, c, K]
        return torch.cat(blocks, dim=1)  # [B, T, K]

    @staticmethod
    def backward(ctx, grad):  # grad [B, T, K]
        q, keys, w, rows = ctx.saved_tensors
        B, T, H, D = q.shape
        S = keys.shape[1]
        dq, dw = torch.zeros_like(q), torch.zeros_like(w)
        dkeys = torch.zeros_like(keys).view(B * S, D)  # [B*S, D]
        flat_base = (torch.arange(B, device=keys.device) * S).view(B, 1, 1)  # [B, 1, 1]
        for t0 in range(0, T, QUERY_BLOCK):
            t1 = min(T, t0 + QUERY_BLOCK)
            picked, dots = _block_dots(q[:, t0:t1], keys, rows[:, t0:t1])  # [B, c, K, D], [B, c, H, K]
            g = grad[:, t0:t1]  # [B, c, K]
            dw[:, t0:t1] = torch.einsum("bck,bchk->bch", g, torch.relu(dots))
            d_dots = g.unsqueeze(2) * w[:, t0:t1].unsqueeze(-1) * (dots > 0)  # [B, c, H, K]
            dq[:, t0:t1] = torch.einsum("bchk,bckd->bchd", d_dots, picked)
            d_picked = torch.einsum("bchk,bchd->bckd", d_dots, q[:, t0:t1])  # [B, c, K, D]
            dkeys.index_add_(0, (flat_base + rows[:, t0:t1]).reshape(-1), d_picked.reshape(-1, D))
        return dq, dkeys.view(B, S, D), dw, None


def selected_index_scores_reference(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor,
                                    topk_idx: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D], keys [B, S, D], w [B, T, H], topk_idx [B, T, K] (-1 = none) -> I_sel [B, T, K] in the
    compute dtype (fp32, fp64 for fp64 inputs), -inf at the -1 slots; differentiable in q, keys and w."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    keep = topk_idx >= 0  # [B, T, K]
    rows = topk_idx.clamp(min=0).long()  # [B, T, K]
    scores = _SelectedScores.apply(q.to(compute), keys.to(compute), w.to(compute), rows)
    return scores.masked_fill(~keep, float("-inf"))
