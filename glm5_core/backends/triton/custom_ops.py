"""``torch.library`` custom ops around the inference kernels, so ``torch.compile`` sees one opaque node
per op (no graph break at the op boundary) and traces shapes through the fake implementations.

Registered lazily, once per vendor namespace (``glm5_<vendor>``), from ``kernel_table()``.
The ops take ``start_pos`` as an int32 [B] tensor (a fixed schema); the table's wrappers convert ints.
"""
from __future__ import annotations

import functools

import torch

from glm5_core.backends.triton import _util, indexer, sparse_mla
from glm5_core.backends.triton.launch import KernelConfigs
from glm5_core.kernel import Kernel


@functools.cache
def register(configs: KernelConfigs) -> dict[str, Kernel]:
    ns = f"glm5_{configs.vendor}"
    indexer_config = configs.get(indexer.FAMILY, indexer.DEFAULT_LAUNCH)
    sparse_mla_config = configs.get(sparse_mla.FAMILY, sparse_mla.DEFAULT_LAUNCH)

    @torch.library.custom_op(f"{ns}::indexer_topk", mutates_args=())
    def indexer_topk_op(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, start: torch.Tensor,
                        topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        return indexer.indexer_topk_and_nan_rows(q, k, w, topk=topk, start_pos=start, config=indexer_config)

    @indexer_topk_op.register_fake
    def _(q, k, w, start, topk):
        B, T = q.shape[:2]
        return q.new_empty((B, T, topk), dtype=torch.int32), q.new_empty((B * T,), dtype=torch.int8)

    @torch.library.custom_op(f"{ns}::sparse_decode", mutates_args=())
    def sparse_decode_op(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                         w_uk: torch.Tensor, w_uv: torch.Tensor, topk_idx: torch.Tensor, scale: float) -> torch.Tensor:
        out = sparse_mla.sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, scale=scale,
                                       config=sparse_mla_config)
        return out.contiguous()  # the fake promises a contiguous result

    @sparse_decode_op.register_fake
    def _(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, scale):
        return q_nope.new_empty((*q_nope.shape[:3], w_uv.shape[1]))

    def indexer_topk(q, k, w, *, topk: int, start_pos=0):
        idx, nan_rows = indexer_topk_op(q, k, w, _util.start_tensor(start_pos, q.shape[0], q.device), topk)
        indexer.raise_if_nan(nan_rows)  # outside the op: skipped while torch.compile traces
        return idx

    def sparse_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, *, scale: float):
        return sparse_decode_op(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, topk_idx, float(scale))

    indexer_topk.__qualname__ = f"indexer_topk (torch.ops.{ns}.indexer_topk)"
    sparse_decode.__qualname__ = f"sparse_decode (torch.ops.{ns}.sparse_decode)"
    return {"dsa_indexer_topk": Kernel(indexer_topk, supports=indexer.supports),
            "dsa_sparse_decode": Kernel(sparse_decode, supports=sparse_mla.fitting(sparse_mla.supports, configs))}
