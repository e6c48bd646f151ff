"""Argument building for MLA decode on ``npu_fused_infer_attention_score`` (pure torch; tested on CPU).

Legend: B batch, T new queries per row, S cache slots, H heads, C latent width (512), Dr rope width (64),
NB cache blocks per row, BS block size, L[b] = start_pos[b] + T keys row b sees.

Vendor contract used (``op-plugin/docs/context/torch_npu-npu_fused_infer_attention_score.md``, the MLA case
"query_rope and key_rope given", query D = 512): query [B, T, H, 512] with T in 1..16 and H in {32, 64, 128},
query_rope [B, T, H, 64]; key/value one head of 512 with key_rope of 64; PageAttention is mandatory (cache
[blocks, BS, 512] for BSND queries, block_size 16 or 128, block_table int32 [B, NB], actual_seq_lengths_kv
given); T = 1 takes sparse_mode 0 without mask, T > 1 takes sparse_mode 3 (causal aligned to the bottom
right) with the 2048 x 2048 compressed mask.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from glm5_core.ops.mla import absorb_query

StartPos = Union[int, torch.Tensor]

BLOCK_SIZE = 128
COMPRESSED_MASK_SIZE = 2048
NO_MASK = 0
CAUSAL_BOTTOM_RIGHT = 3


def paged_cache(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a contiguous cache [B, S, X] into blocks: ([B * NB, BS, X], block_table int32 [B, NB]).

    S is zero-padded up to NB * BS; the padding is never read because the lengths stop at L[b] <= S."""
    B, S, X = cache.shape
    blocks = -(-S // block_size)
    if blocks * block_size != S:
        cache = torch.cat([cache, cache.new_zeros(B, blocks * block_size - S, X)], dim=1)  # [B, NB*BS, X]
    paged = cache.reshape(B * blocks, block_size, X).contiguous()  # row b owns blocks b*NB .. b*NB+NB-1
    table = torch.arange(B * blocks, dtype=torch.int32, device=cache.device).view(B, blocks)
    return paged, table


def compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The fixed 2048 x 2048 mask sparse_mode 3 takes: True (masked) strictly above the diagonal."""
    ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def key_lengths(start_pos: StartPos, batch: int, queries: int) -> list[int]:
    """L[b] = start_pos[b] + T as host ints (the op takes SymInt[] lengths)."""
    if isinstance(start_pos, torch.Tensor):
        return [int(p) + queries for p in start_pos.tolist()]
    return [int(start_pos) + queries] * batch


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    query: torch.Tensor  # [B, T, H, C] absorbed
    query_rope: torch.Tensor  # [B, T, H, Dr]
    key_cache: torch.Tensor  # [B * NB, BS, C]; also the value cache
    key_rope_cache: torch.Tensor  # [B * NB, BS, Dr]
    block_table: torch.Tensor  # int32 [B, NB]
    actual_seq_lengths: list[int]  # T per row
    actual_seq_lengths_kv: list[int]  # L[b]
    sparse_mode: int
    atten_mask: Optional[torch.Tensor]
    scale: float

    def args(self):
        return (self.query, self.key_cache, self.key_cache)

    def kwargs(self) -> dict[str, object]:
        return dict(query_rope=self.query_rope, key_rope=self.key_rope_cache, atten_mask=self.atten_mask,
                    actual_seq_lengths=self.actual_seq_lengths, actual_seq_lengths_kv=self.actual_seq_lengths_kv,
                    block_table=self.block_table, block_size=BLOCK_SIZE, num_heads=self.query.shape[2],
                    num_key_value_heads=1, input_layout="BSND", scale=self.scale, sparse_mode=self.sparse_mode)


def decode_call(q_nope, q_pe, c_kv, k_pe, w_uk, scale: float, start_pos: StartPos) -> DecodeCall:
    """q_nope [B, T, H, Dn] is absorbed into the 512-wide latent in fp32 (as the reference), rounded once."""
    B, T = q_nope.shape[:2]
    q_lat = absorb_query(q_nope.float(), w_uk.float()).to(q_nope.dtype)  # [B, T, H, C]
    key_cache, table = paged_cache(c_kv, BLOCK_SIZE)  # [B*NB, BS, C], [B, NB]
    rope_cache, _ = paged_cache(k_pe, BLOCK_SIZE)  # [B*NB, BS, Dr]
    multi_query = T > 1
    return DecodeCall(
        query=q_lat.contiguous(), query_rope=q_pe.contiguous(), key_cache=key_cache, key_rope_cache=rope_cache,
        block_table=table, actual_seq_lengths=[T] * B, actual_seq_lengths_kv=key_lengths(start_pos, B, T),
        sparse_mode=CAUSAL_BOTTOM_RIGHT if multi_query else NO_MASK,
        atten_mask=compressed_causal_mask(q_nope.device) if multi_query else None, scale=float(scale))
