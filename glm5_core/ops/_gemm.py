"""The indexers' q . k GEMM with a summation order that depends on neither the query count nor the key count
(``glm5_core.ops.dsa`` says why): shared by the indexer top-k and the k-pool indexer top-k."""
from __future__ import annotations

import torch

GEMM_ROW_BLOCK = 16
GEMM_KEY_BLOCK = 128  # MKL: fp32 GEMMs agree from 16 keys up, fp64 ones only past ~100


def pad_rows(t: torch.Tensor, block: int) -> torch.Tensor:
    """[B, n, D] -> [B, n rounded up to a multiple of block, D], zero rows appended."""
    B, n, D = t.shape
    padded = -(-n // block) * block
    return t if padded == n else torch.cat([t, t.new_zeros(B, padded - n, D)], dim=1)


def rows_dot_keys(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """rows [B, M, D] . keys [B, S, D] -> [B, M, S] with a summation order independent of M and S."""
    M, S = rows.shape[1], keys.shape[1]
    padded_rows = pad_rows(rows, GEMM_ROW_BLOCK)  # [B, M', D]
    padded_keys = pad_rows(keys, GEMM_KEY_BLOCK)  # [B, S', D]
    return torch.matmul(padded_rows, padded_keys.transpose(1, 2))[:, :M, :S]  # [B, M, S]
