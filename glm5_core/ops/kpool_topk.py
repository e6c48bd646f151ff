"""The k-pool indexer's top-k (GLM-5.3's DSA indexer, transformers 5.25 ``Glm5NextTextIndexer``): the reference of
``dsa_kpool_topk`` and the pooling and expansion steps every backend shares.

Legend: B batch, T queries, S key slots, H indexer heads, D index_head_dim, P = S // kpool complete pools,
J = topk // kpool pools selected, W output width (topk, plus kpool - 1 with the tail).

Pooling (``pool_keys``): pool j holds tokens j*kpool .. (j+1)*kpool - 1, only complete pools exist; its key is
the per-channel softmax-weighted sum of its tokens' keys, the weights from ``gate + ape`` (gate = the tokens'
``index_kpool_compress_gate`` projection [B, S, D], ape [kpool, D] the ``index_kpool_compress_ape``)::

    pk[b, j, :] = sum_i softmax_i(gate[b, j*kpool + i, :] + ape[i, :]) * k[b, j*kpool + i, :]

(the softmax and the sum in token order, elementwise, so a pool's key never depends on B, S or chunking).

Score of pool j for query t:  I[b,t,j] = sum_h (w[b,t,h] * scale) * ReLU(q[b,t,h,:] . pk[b,j,:]), in head order
(transformers: ReLU(scale * q . pk) weighted by w: the same function; ReLU commutes with the positive scale
exactly, only the rounding of w * scale differs). Pool j is visible to the query at position p when its last
token is: (j + 1) * kpool - 1 <= p.

Output (int32 [B, T, W]): the J best visible pools (score descending, ties to the LOWER pool index), each
expanded to its kpool token indices ascending; then, with ``select_tail`` (``index_kpool_always_select_tail``),
the query's incomplete tail group -- tokens p + 1 - ((p + 1) % kpool) .. p, ascending -- always; then -1 padding.
A row holds min(J, (p + 1) // kpool) * kpool + (tail ? (p + 1) % kpool : 0) indices, then -1: the same SET of
keys transformers' indexer selects for an unpadded row (its layout interleaves -1 blocks; the attention they
drive is the same), and the same layout whatever S is, so prefill and decode agree bitwise.
"""
from __future__ import annotations

from typing import Union

import torch

from glm5_core.ops import _checks
from glm5_core.ops._gemm import rows_dot_keys  # the padded GEMM whose rounding does not depend on T or P

StartPos = Union[int, torch.Tensor]


def pool_keys(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """The complete pools' keys [B, P, D] in the compute dtype (fp32; fp64 for fp64 keys)."""
    ct = _checks.compute_dtype(k.dtype)
    B, S, D = k.shape
    P = S // kpool
    keys = k[:, :P * kpool].to(ct).reshape(B, P, kpool, D)  # [B, P, kpool, D]
    logits = gate[:, :P * kpool].to(ct).reshape(B, P, kpool, D) + ape.to(ct)  # [B, P, kpool, D]
    # the maximum is exact whatever the order (a signed zero in it changes no exp below); exp, division and product
    # are elementwise over whole contiguous tensors (torch's vectorised kernels, as over each token's slice)
    exp = torch.exp(logits - logits.amax(dim=2, keepdim=True))  # [B, P, kpool, D]
    exps = exp.unbind(2)  # kpool x [B, P, D]
    total = exps[0]
    for i in range(1, kpool):  # the sums in token order: no reduction kernel whose order depends on shapes
        total = total + exps[i]
    weighted = (exp / total.unsqueeze(2) * keys).unbind(2)  # kpool x [B, P, D]: (e_i / total) * k_i
    pooled = weighted[0]
    for i in range(1, kpool):
        pooled = pooled + weighted[i]
    return pooled  # [B, P, D]


def visible_pools(start_pos: StartPos, batch: int, num_queries: int, kpool: int, device) -> torch.Tensor:
    """How many complete pools each query sees: (p + 1) // kpool, int64 [B, T]."""
    return (_checks.query_positions(start_pos, batch, num_queries, device) + 1) // kpool


def expand(pool_idx: torch.Tensor, start_pos: StartPos, *, topk: int, kpool: int, select_tail: bool) -> torch.Tensor:
    """Selected pools int [B, T, J] (-1 = none; the valid ones first) -> the contract's token indices
    int32 [B, T, W] (see the module docstring)."""
    B, T, J = pool_idx.shape
    device = pool_idx.device
    offsets = torch.arange(kpool, device=device)  # [kpool]
    pools = pool_idx.to(torch.int64)
    tokens = pools.unsqueeze(-1) * kpool + offsets  # [B, T, J, kpool]
    tokens = torch.where(pools.unsqueeze(-1) >= 0, tokens, -1).reshape(B, T, J * kpool)
    if J * kpool < topk:  # fewer pools than topk // kpool exist at all
        tokens = torch.cat([tokens, tokens.new_full((B, T, topk - J * kpool), -1)], dim=-1)
    if select_tail and kpool > 1:
        pos = _checks.query_positions(start_pos, B, T, device)  # [B, T]
        count = (pos + 1) % kpool  # tokens in the incomplete group
        first = pos + 1 - count
        tail_offsets = offsets[:kpool - 1]
        tail = first.unsqueeze(-1) + tail_offsets  # [B, T, kpool - 1]
        tail = torch.where(tail_offsets < count.unsqueeze(-1), tail, -1)
        tokens = torch.cat([tokens, tail], dim=-1)  # [B, T, W]
    # valid entries first, in their order (pool tokens, then tail): a stable sort of the "is -1" flags
    order = torch.sort((tokens < 0).to(torch.int8), dim=-1, stable=True).indices
    return tokens.gather(-1, order).to(torch.int32)


def kpool_scores_reference(q, pooled, w, *, scale: float, start_pos: StartPos, kpool: int) -> torch.Tensor:
    """I[b, t, j] [B, T, P] in the compute dtype, -inf for pools not visible."""
    ct = pooled.dtype
    B, T, H, D = q.shape
    P = pooled.shape[1]
    dots = rows_dot_keys(q.to(ct).reshape(B, T * H, D), pooled).view(B, T, H, P)  # [B, T, H, P]
    heads, head_w = torch.relu(dots).unbind(2), (w.to(ct) * scale).unbind(2)
    scores = head_w[0].unsqueeze(-1) * heads[0]  # [B, T, P]
    for h in range(1, H):  # fixed head order
        scores = scores + head_w[h].unsqueeze(-1) * heads[h]
    seen = visible_pools(start_pos, B, T, kpool, q.device)  # [B, T]
    visible = torch.arange(P, device=q.device).view(1, 1, P) < seen.unsqueeze(-1)
    return scores.masked_fill(~visible, float("-inf"))


def kpool_topk_reference(q, k, w, gate, ape, *, topk: int, kpool: int, select_tail: bool, scale: float,
                         start_pos: StartPos = 0) -> torch.Tensor:
    """int32 [B, T, W]: the k-pool top-k contract (module docstring)."""
    B, T = q.shape[:2]
    pooled = pool_keys(k, gate, ape, kpool)  # [B, P, D]
    scores = kpool_scores_reference(q, pooled, w, scale=scale, start_pos=start_pos, kpool=kpool)  # [B, T, P]
    if bool(torch.isnan(scores).any()):
        raise ValueError("q, k, w, gate: k-pool indexer scores overflowed to NaN; rescale the inputs")
    J = min(topk // kpool, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :J]  # [B, T, J]
    n_valid = torch.clamp(visible_pools(start_pos, B, T, kpool, q.device), max=J)  # [B, T]
    order = torch.where(torch.arange(J, device=q.device) < n_valid.unsqueeze(-1), order, -1)
    return expand(order, start_pos, topk=topk, kpool=kpool, select_tail=select_tail)
