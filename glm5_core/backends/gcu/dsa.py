"""The DSA indexer's top-k without int64, for devices that compute no int64 (Enflame GCUs): the selection is made in
int32 only, bitwise equal to the reference's (``glm5_core.ops.dsa.indexer_topk_reference``: scores descending, ties
by the LOWER key index, -0.0 equal to +0.0, the first ``pos + 1`` visible keys of a query at position ``pos``).

torch's ``sort`` / ``topk`` return int64 indices, so they are not used. Each score is mapped to an int32 whose integer
order is the float order (the sign bit flips the magnitude bits of negatives; -0.0 folded onto +0.0 first), and a
bitonic network (compare-exchange on reshaped views: no index tensor at all) sorts (key, index) pairs of each query
row, the row padded to a power of two with keys below every score. Cost O(S log^2 S) per query row, in row chunks
of a bounded size. The scores themselves are the reference's (torch operators, fp32).
"""
from __future__ import annotations

from typing import Callable

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import dsa as dsa_ops

INT32_MIN = -(2 ** 31)
CHUNK_ELEMENTS = 1 << 22  # (rows x padded keys) sorted at once


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int32 keys in the same order (equal scores, -0.0 and +0.0 included, give equal keys)."""
    bits = (scores.to(torch.float32) + 0.0).view(torch.int32)  # -0.0 + 0.0 == +0.0
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def bitonic_sort_desc(keys: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort int32 ``keys`` [..., n] (n a power of two) descending, ties by the lower int32 ``index``; the pairs
    travel together. Only compare-exchanges of reshaped halves: no index tensor is formed."""
    n = keys.shape[-1]
    if n & (n - 1):
        raise ValueError(f"keys: expected a power-of-two last dim, got {n}")
    lead = keys.shape[:-1]
    size = 2
    while size <= n:
        stride = size // 2
        while stride >= 1:
            blocks = n // (2 * stride)
            k = keys.reshape(*lead, blocks, 2, stride)
            i = index.reshape(*lead, blocks, 2, stride)
            a_k, b_k, a_i, b_i = k[..., 0, :], k[..., 1, :], i[..., 0, :], i[..., 1, :]
            a_first = (a_k > b_k) | ((a_k == b_k) & (a_i < b_i))
            start = torch.arange(blocks, dtype=torch.int32, device=keys.device) * (2 * stride)
            descending = ((start & size) == 0).view(blocks, 1)  # the final merge (size == n) is descending
            keep = a_first == descending
            keys = torch.stack((torch.where(keep, a_k, b_k), torch.where(keep, b_k, a_k)), dim=-2).reshape(*lead, n)
            index = torch.stack((torch.where(keep, a_i, b_i), torch.where(keep, b_i, a_i)), dim=-2).reshape(*lead, n)
            stride //= 2
        size *= 2
    return keys, index


def topk_int32(scores: torch.Tensor, topk: int, start_pos) -> torch.Tensor:
    """The top-k contract on masked scores [B, T, S] -> int32 [B, T, topk], int32 throughout."""
    B, T, S = scores.shape
    if bool(torch.isnan(scores).any()):
        raise ValueError("q, k, w: indexer scores overflowed to NaN; rescale the inputs")
    n = 1 << max(0, (S - 1).bit_length())
    keys = ordered_keys(scores).reshape(B * T, S)
    if n > S:
        keys = torch.cat([keys, keys.new_full((B * T, n - S), INT32_MIN)], dim=-1)
    width = min(topk, S)
    rows = max(1, CHUNK_ELEMENTS // n)
    order = torch.empty((B * T, width), dtype=torch.int32, device=scores.device)
    positions = torch.arange(n, dtype=torch.int32, device=scores.device)
    for r0 in range(0, B * T, rows):
        chunk = keys[r0:r0 + rows]
        _, index = bitonic_sort_desc(chunk, positions.expand(chunk.shape[0], n))
        order[r0:r0 + rows] = index[:, :width]
    order = order.view(B, T, width)
    if width < topk:  # fewer key slots than k
        order = torch.cat([order, order.new_full((B, T, topk - width), -1)], dim=-1)
    if isinstance(start_pos, torch.Tensor):  # [B] (the caller's dtype) -> int32 [B, 1]
        start = start_pos.to(device=scores.device, dtype=torch.int32).reshape(-1, 1)
    else:
        start = torch.full((1, 1), int(start_pos), dtype=torch.int32, device=scores.device)
    pos = start + torch.arange(T, dtype=torch.int32, device=scores.device)  # [B or 1, T]
    n_valid = torch.clamp(pos + 1, max=width).expand(B, T)
    rank = torch.arange(topk, dtype=torch.int32, device=scores.device)
    return torch.where(rank < n_valid.unsqueeze(-1), order, torch.full_like(order, -1))


def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, topk: int, start_pos=0) -> torch.Tensor:
    """The indexer top-k (the reference's scores, the int32-only selection)."""
    return topk_int32(dsa_ops.indexer_scores_reference(q, k, w, start_pos=start_pos), topk, start_pos)


def supports(runtime_device: Callable[[], str]):
    """The capability check of this top-k: tensors on the backend's runtime device type (``runtime_device()``, asked
    at each call); fp64 scores are declined (the int32 keys order fp32 scores)."""

    def check(q, k, w, *, topk: int, start_pos=0):
        device_type = runtime_device()
        for name, t in (("q", q), ("k", k), ("w", w)):
            if t.device.type != device_type:
                return False, f"{name} is on {t.device.type}, this kernel runs on {device_type} tensors"
        if q.dtype == torch.float64:
            return False, "fp64 scores: the int32 keys order fp32 scores"
        return True, ""

    return check


def kernels(runtime_device: Callable[[], str]) -> dict[str, Kernel]:
    return {"dsa_indexer_topk": Kernel(indexer_topk, supports=supports(runtime_device))}
