"""cpu backend kernels for DSA: the fused streaming indexer top-k and sparse MLA attention.

Each takes exactly the arguments of its reference (``glm5_core.ops.dsa``), already validated, and calls
the native ``torch.ops.glm5_cpu`` ops. Sparse prefill and sparse decode share one contract (absorbed MLA
over the selected latent rows, any number of queries) and one kernel; it has no backward, so a prefill
that needs gradients (training) runs the reference (the registry routes it: ``differentiable`` is False).
Legend as in ``glm5_core.ops.dsa``.
"""
from __future__ import annotations

from typing import Mapping, Tuple

import torch

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks
from glm5_core.ops.mla import absorb_query, project_output


def _on_cpu(*tensors) -> Tuple[bool, str]:
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if devices != {"cpu"}:
        return False, f"native CPU kernels need CPU tensors, got {sorted(devices)}"
    return True, ""


def _start_tensor(start_pos, batch: int) -> torch.Tensor:
    if isinstance(start_pos, torch.Tensor):
        return start_pos.to(torch.int64)
    return torch.full((batch,), int(start_pos), dtype=torch.int64)  # [B]


def indexer_topk(q, k, w, *, topk: int, start_pos=0) -> torch.Tensor:
    """int32 [B, T, topk]: the top-k contract, computed without materialising the [B, T, S] scores."""
    ct = _checks.compute_dtype(q.dtype)
    return torch.ops.glm5_cpu.indexer_topk(q.to(ct), k.to(ct), w.to(ct), _start_tensor(start_pos, q.shape[0]), topk)


def _indexer_supports(q, k, w, *, topk: int, start_pos=0):
    return _on_cpu(q, k, w, start_pos)


def sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float) -> torch.Tensor:
    """[B, T, Hm, Dv]: absorbed MLA over the selected latent rows, read in place from the cache."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_lat = absorb_query(q_nope.to(ct), w_uk.to(ct))  # [B, T, Hm, C]
    o_lat = torch.ops.glm5_cpu.sparse_decode(q_lat, q_pe.to(ct), c_kv, k_pe, topk_idx, float(scale))  # [B, T, Hm, C]
    return project_output(o_lat, w_uv.to(ct)).to(out_dtype)


def _sparse_supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float):
    return _on_cpu(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx)


def sparse_prefill(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float) -> torch.Tensor:
    """[B, T, Hm, Dv]: the same kernel as decode (rows are independent queries, batch invariant), so an
    inference prefill and the decode steps after it compute every query the same way."""
    return sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, scale=scale)


KERNELS: Mapping[str, Kernel] = {
    "dsa_indexer_topk": Kernel(indexer_topk, supports=_indexer_supports),
    "dsa_sparse_decode": Kernel(sparse_decode, supports=_sparse_supports),
    "dsa_sparse_prefill": Kernel(sparse_prefill, supports=_sparse_supports),
}
