"""Build a backend's kernel table from the vendor-neutral Triton launchers and a vendor's launch configs.

Imported only from ``kernel_table()`` (it imports triton). Each record's function keeps the launcher's
module and name (so ``glm5 backends`` shows what an op resolves to) and carries the launcher's ``supports``
hook, so calls outside a kernel's capabilities run the reference with a reason.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional

from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig
from glm5_core.kernel import Kernel


def bind(fn: Callable, config: LaunchConfig, supports: Optional[Callable] = None,
         differentiable: bool = False) -> Kernel:
    """A kernel record running ``fn`` with ``config=`` fixed (keeping ``fn``'s name for ``explain``)."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        return fn(*args, config=config, **kwargs)

    return Kernel(kernel, supports=supports, differentiable=differentiable)


def build_kernel_table(configs: KernelConfigs) -> Dict[str, Kernel]:
    from glm5_core.backends.triton import (
        attention_target,
        custom_ops,
        indexer,
        moe_experts,
        moe_permute,
        moe_route,
        newton_schulz,
        sparse_mla,
    )

    mla = configs["sparse_mla"]
    table = {
        "dsa_indexer_scores": bind(indexer.indexer_scores, configs["indexer"], indexer.supports),
        "dsa_indexer_topk": bind(indexer.indexer_topk, configs["indexer"], indexer.supports),
        "dsa_sparse_prefill": bind(sparse_mla.sparse_prefill, mla, sparse_mla.fitting(sparse_mla.supports, configs),
                                   differentiable=True),  # backward through _SparseLatentAttention
        "dsa_sparse_decode": bind(sparse_mla.sparse_decode, mla, sparse_mla.fitting(sparse_mla.supports, configs)),
        "dsa_selected_attention_target": bind(attention_target.selected_attention_target,
                                              configs[attention_target.FAMILY], attention_target.fitting(configs)),
        "mla_decode": bind(sparse_mla.dense_decode, mla, sparse_mla.fitting(sparse_mla.dense_decode_supports, configs)),
        "moe_route": bind(moe_route.route, configs["moe_route"], moe_route.supports),
        "moe_dispatch": bind(moe_permute.dispatch, configs["moe_permute"], differentiable=True),
        "moe_combine": bind(moe_permute.combine, configs["moe_permute"], moe_permute.combine_supports,
                            differentiable=True),  # backwards: moe_permute._Dispatch / _Combine
        "moe_experts": bind(moe_experts.grouped_swiglu, configs["grouped_gemm"], moe_experts.supports,
                            differentiable=True),  # backward through _GroupedSwiGLU (moe_experts_bwd)
        "muon_orthogonalize": bind(newton_schulz.orthogonalize, configs["newton_schulz"], newton_schulz.supports),
    }
    table.update(custom_ops.register(configs))  # inference ops as torch.library custom ops (torch.compile)
    return table
