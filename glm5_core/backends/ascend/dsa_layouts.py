"""Argument building and result conversion for the DSA vendor ops (pure torch: runs and is tested on CPU).

Legend (sizes): B batch, T queries per row, S key slots, H indexer heads (padded to HV = 64 for the vendor),
D index head dim (128), K top-k, R candidates asked of the vendor (K + 1 where possible), L[b] keys row b
sees (start_pos[b] + T), Hm attention heads, C latent width (512), Dr rope width (64).

Vendor contracts used here (Ascend ``op-plugin/docs/context/torch_npu-npu_lightning_indexer.md`` and
``op-plugin/docs/context/torch_npu-npu_sparse_flash_attention.md``):
  * npu_lightning_indexer: query BSND [B, S1, N1, D] or TND [T1, N1, D] with N1 = 64 and D = 128; key with
    one head; weights [B, S1, N1] / [T1, N1]; query, key and weights in one dtype (fp16/bf16); lengths are
    int32, per row for BSND and int32 *prefix sums* for TND; sparse_mode 3 = causal aligned to the bottom
    right (query i of a row with S1 queries and S2 keys sees keys 0 .. S2 - S1 + i); sparse_count in
    [1, 2048]; output int32 [B, S1, 1, sparse_count] / [T1, 1, sparse_count], positions inside the row's
    key sequence, -1 where fewer keys are visible. The order among equal scores is not documented.
  * npu_sparse_flash_attention, attention_mode 2 (MLA absorbed): query [B, S1, N1, 512] with query_rope
    [..., 64], key = value [B, S2, 1, 512] with key_rope [..., 64], sparse_indices int32 [B, S1, 1, K] whose
    valid entries come first and -1 entries last.
"""
from __future__ import annotations

import dataclasses
from typing import Union

import torch

from glm5_core.ops import _checks
from glm5_core.ops.mla import absorb_query

StartPos = Union[int, torch.Tensor]

MAX_SPARSE_COUNT = 2048
VENDOR_QUERY_HEADS = 64
VENDOR_INDEX_HEAD_DIM = 128
CAUSAL_BOTTOM_RIGHT = 3
ALL_KEYS = 0
RESCORE_QUERY_CHUNK = 64  # bounds the gathered [B, chunk, R, D] keys of the re-scoring
GEMM_ROW_BLOCK = 16


def prefix_sums(lengths: torch.Tensor) -> torch.Tensor:
    """TND layouts take cumulative lengths: [3, 5, 2] -> int32 [3, 8, 10]."""
    return torch.cumsum(lengths.to(torch.int64), dim=0).to(torch.int32)


def pad_query_heads(q: torch.Tensor, w: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad H heads to ``heads`` with zero queries and zero weights: each padded head adds w * ReLU(0) = +0.0,
    which leaves every score bit-identical. q [B, T, H, D] -> [B, T, heads, D]; w [B, T, H] -> [B, T, heads]."""
    B, T, H, D = q.shape
    assert H <= heads, "callers decline more heads than the vendor takes"
    if H == heads:
        return q, w
    q = torch.cat([q, q.new_zeros(B, T, heads - H, D)], dim=2)
    w = torch.cat([w, w.new_zeros(B, T, heads - H)], dim=2)
    return q, w


@dataclasses.dataclass(frozen=True)
class IndexerCall:
    """Everything ``npu_lightning_indexer`` is called with, plus what turns its output back into [B, T, R]."""

    query: torch.Tensor
    key: torch.Tensor
    weights: torch.Tensor
    actual_seq_lengths_query: torch.Tensor
    actual_seq_lengths_key: torch.Tensor
    layout: str  # "BSND" (one start position for all rows) or "TND" (ragged start positions)
    sparse_count: int
    batch: int
    queries: int

    def kwargs(self) -> dict[str, object]:
        return dict(actual_seq_lengths_query=self.actual_seq_lengths_query,
                    actual_seq_lengths_key=self.actual_seq_lengths_key, block_table=None,
                    layout_query=self.layout, layout_key=self.layout, sparse_count=self.sparse_count,
                    sparse_mode=CAUSAL_BOTTOM_RIGHT)


def indexer_call(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, start_pos: StartPos,
                 sparse_count: int) -> IndexerCall:
    """Lay out q [B, T, H, D], k [B, S, D], w [B, T, H] for the vendor.

    Row b's queries sit at positions start_pos[b] .. start_pos[b] + T - 1, so the row must present exactly
    L[b] = start_pos[b] + T keys: bottom-right causal alignment then gives query t the keys 0 .. start_pos[b] + t,
    which is our causal rule. Keys past L[b] (unwritten cache slots) are left out through the lengths."""
    B, T, H, D = q.shape
    S = k.shape[1]
    device = q.device
    w = w.to(q.dtype)  # callers only let exact casts through (see dsa.indexer_topk_limits)
    q, w = pad_query_heads(q, w, VENDOR_QUERY_HEADS)  # [B, T, 64, D], [B, T, 64]
    if isinstance(start_pos, torch.Tensor):
        key_lengths = start_pos.to(device=device, dtype=torch.int64) + T  # [B]
        query_lengths = torch.full((B,), T, dtype=torch.int64, device=device)  # [B]
        keep = torch.arange(S, device=device).view(1, S) < key_lengths.view(B, 1)  # [B, S]
        return IndexerCall(
            query=q.reshape(B * T, VENDOR_QUERY_HEADS, D).contiguous(),  # [T1 = B*T, 64, D]
            key=k[keep].unsqueeze(1).contiguous(),  # [T2 = sum L, 1, D], rows packed one after another
            weights=w.reshape(B * T, VENDOR_QUERY_HEADS).contiguous(),  # [T1, 64]
            actual_seq_lengths_query=prefix_sums(query_lengths),
            actual_seq_lengths_key=prefix_sums(key_lengths),
            layout="TND", sparse_count=sparse_count, batch=B, queries=T)
    return IndexerCall(
        query=q.contiguous(),  # [B, T, 64, D]
        key=k.unsqueeze(2).contiguous(),  # [B, S, 1, D]
        weights=w.contiguous(),  # [B, T, 64]
        actual_seq_lengths_query=torch.full((B,), T, dtype=torch.int32, device=device),
        actual_seq_lengths_key=torch.full((B,), int(start_pos) + T, dtype=torch.int32, device=device),
        layout="BSND", sparse_count=sparse_count, batch=B, queries=T)


def candidates_from_vendor(raw: torch.Tensor, call: IndexerCall) -> torch.Tensor:
    """Vendor indices ([B, T, 1, R] or [T1, 1, R], int32) -> int64 [B, T, R]; entries stay row-local, -1 kept."""
    expected = (call.batch, call.queries, 1, call.sparse_count) if call.layout == "BSND" \
        else (call.batch * call.queries, 1, call.sparse_count)
    if tuple(raw.shape) != expected:
        raise RuntimeError(f"npu_lightning_indexer returned shape {tuple(raw.shape)}, expected {expected} "
                           f"for layout {call.layout}")
    return raw.reshape(call.batch, call.queries, call.sparse_count).to(torch.int64)


def rescore(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Indexer scores of the candidate keys only, fp32 [B, T, R] (-inf at -1 entries): the vendor returns the
    selected positions but not their order among equal scores, so the order is restored from these.

    Equal keys must get bit-equal scores wherever they sit in the list, so each query's candidates are the
    *rows* of one GEMM (row count padded to a block multiple, the reference's trick against tail paths) and
    its heads the columns; the head sum then runs in head order, as in the reference."""
    B, T, H, D = q.shape
    R = cand.shape[-1]
    padded = -(-R // GEMM_ROW_BLOCK) * GEMM_ROW_BLOCK
    batch = torch.arange(B, device=q.device).view(B, 1, 1)  # [B, 1, 1]
    out = []
    for t0 in range(0, T, RESCORE_QUERY_CHUNK):
        c = cand[:, t0:t0 + RESCORE_QUERY_CHUNK]  # [B, t, R]
        t = c.shape[1]
        keys = k[batch, c.clamp(min=0)].float().reshape(B * t, R, D)  # [B*t, R, D]
        if padded != R:
            keys = torch.cat([keys, keys.new_zeros(B * t, padded - R, D)], dim=1)  # [B*t, padded, D]
        queries = q[:, t0:t0 + t].float().reshape(B * t, H, D).transpose(1, 2)  # [B*t, D, H]
        dots = torch.bmm(keys, queries)[:, :R].reshape(B, t, R, H)  # [B, t, R, H]
        wt = w[:, t0:t0 + t].float()  # [B, t, H]
        scores = wt[:, :, None, 0] * torch.relu(dots[..., 0])  # [B, t, R]
        for h in range(1, H):  # head order, as the reference
            scores = scores + wt[:, :, None, h] * torch.relu(dots[..., h])
        out.append(scores.masked_fill(c < 0, float("-inf")))
    return torch.cat(out, dim=1)


def canonical_order(cand: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort candidates [B, T, R] by score descending, ties to the LOWER key index, -1 entries last.

    Two stable sorts: by index first, then by score; equal scores keep the index order of the first sort."""
    big = torch.iinfo(torch.int64).max
    by_index = torch.sort(torch.where(cand >= 0, cand, torch.full_like(cand, big)), dim=-1, stable=True).indices
    cand, scores = cand.gather(-1, by_index), scores.gather(-1, by_index)
    by_score = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return cand.gather(-1, by_score), scores.gather(-1, by_score)


def boundary_ties(scores_sorted: torch.Tensor, cand_sorted: torch.Tensor, topk: int) -> torch.Tensor:
    """bool [B, T]: rows whose (topk+1)-th candidate scores the same as the topk-th. Such a tie may extend to
    keys the vendor left out (possibly with lower indices), so those rows are recomputed by the reference."""
    if cand_sorted.shape[-1] <= topk:
        return torch.zeros(cand_sorted.shape[:2], dtype=torch.bool, device=cand_sorted.device)
    extra_valid = cand_sorted[..., topk] >= 0
    return extra_valid & (scores_sorted[..., topk] == scores_sorted[..., topk - 1])


# ----------------------------------------------------------------------------- sparse flash attention
def compact_indices(topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our topk_idx [B, T, K] may hold -1 anywhere; the vendor wants valid entries first. Attention over a
    set of keys does not depend on their order, so a stable partition (valid first) changes nothing but
    the summation order. A row without any key gets the dummy index 0 (its output is zeroed afterwards,
    the reference's rule), so the vendor never sees an empty row.
    Returns (int32 [B, T, 1, K], has_key bool [B, T])."""
    invalid = topk_idx < 0
    order = torch.sort(invalid.to(torch.int8), dim=-1, stable=True).indices  # valid (0) before invalid (1)
    packed = topk_idx.to(torch.int64).gather(-1, order)  # [B, T, K]
    has_key = ~invalid.all(-1)  # [B, T]
    packed[..., 0] = torch.where(has_key, packed[..., 0], torch.zeros_like(packed[..., 0]))
    return packed.to(torch.int32).unsqueeze(2).contiguous(), has_key


@dataclasses.dataclass(frozen=True)
class SparseAttentionCall:
    query: torch.Tensor  # [B, T, Hm, C] absorbed queries
    key: torch.Tensor  # [B, S, 1, C]; also the value (attention_mode 2 shares one latent tensor)
    sparse_indices: torch.Tensor  # int32 [B, T, 1, K]
    query_rope: torch.Tensor  # [B, T, Hm, Dr]
    key_rope: torch.Tensor  # [B, S, 1, Dr]
    scale: float
    has_key: torch.Tensor  # bool [B, T]

    def args(self):
        return (self.query, self.key, self.key, self.sparse_indices, self.scale)

    def kwargs(self) -> dict[str, object]:
        # sparse_mode 0: attend to exactly the given keys (our contract); causality is the indexer's job.
        return dict(block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                    query_rope=self.query_rope, key_rope=self.key_rope, sparse_block_size=1,
                    layout_query="BSND", layout_kv="BSND", sparse_mode=ALL_KEYS, attention_mode=2,
                    return_softmax_lse=False)


def sparse_attention_call(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, scale: float) -> SparseAttentionCall:
    """Absorb W_UK into the queries in fp32 (as the reference), then round once to the input dtype."""
    q_lat = absorb_query(q_nope.float(), w_uk.float()).to(q_nope.dtype)  # [B, T, Hm, C]
    indices, has_key = compact_indices(topk_idx)
    return SparseAttentionCall(query=q_lat.contiguous(), key=c_kv.unsqueeze(2).contiguous(),
                               sparse_indices=indices, query_rope=q_pe.contiguous(),
                               key_rope=k_pe.unsqueeze(2).contiguous(), scale=float(scale), has_key=has_key)


def query_positions(start_pos: StartPos, B: int, T: int, device: torch.device) -> torch.Tensor:
    """Absolute positions int64 [B, T] (the ops' own helper)."""
    return _checks.query_positions(start_pos, B, T, device)
