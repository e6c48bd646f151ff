"""DeepEP's expert-parallel outputs as glm5-core's ``ep_dispatch`` contract (pure torch; tested on CPU against a
stand-in written from DeepEP's source, ``tests/backends/cuda/test_ep_layouts.py``).

Read from deepseek-ai/DeepEP at commit dd758caf451848bd150e1046af3d0a73e5fff38d (``deep_ep.__version__``
'2.1.0'): the V2 API is ``deep_ep.ElasticBuffer`` (``deep_ep/buffers/elastic.py``; the V1 ``Buffer`` is now
``deep_ep/buffers/legacy.py``). ``ElasticBuffer.dispatch(x bf16 [T, H], topk_idx [T, K] (deep_ep.topk_idx_t,
-1 = no selection), topk_weights fp32 [T, K], num_experts=..., do_expand=True, expert_alignment=a)`` returns
``(recv_x, recv_topk_idx, recv_topk_weights, handle: EPHandle, event)``. In the expanding layout (one slot per
expert per token) recv_x is grouped by local expert, each expert's block padded to a multiple of
``expert_alignment``; ``handle.num_unaligned_recv_tokens_per_expert`` [L] holds the real counts and
``handle.psum_num_recv_tokens_per_expert[i]`` = the aligned rows of the experts before i + expert i's real count,
so expert i's rows start at ``psum[i] - unaligned[i]``. With ``ElasticBuffer(..., deterministic=True)`` the
epilogue ``EPHandle.deterministic_sort`` orders the rows inside each expert by the source token's global index
(``recv_src_metadata[:, 0]``), padding last. That index is rank-major (``deep_ep/utils/refs.py``:
"src_token_global_idx = src_rank_idx*num_max_tokens_per_rank + src_token_local_idx"), so the contract's row order
is reproduced EXACTLY, since a token names an expert in one slot only. Without ``deterministic`` the order is the
arrival order: not the contract.

``ElasticBuffer.combine(y, handle)`` sums each token's rows (already weighted by the caller: the expanded send
takes no weights) inside the kernel and returns bf16 (bf16 adds at <= 2 slots, else fp32 rounded once): not the
contract's fp32 slot-order weighted sum. The kernels that use this mapping are ``backends/cuda/ep.py``.
"""
from __future__ import annotations

import importlib.util

import torch

Decision = tuple[bool, str]
VERSION_READ = "2.1.0"
COMMIT_READ = "dd758caf451848bd150e1046af3d0a73e5fff38d"


def deep_ep_importable() -> Decision:
    """Whether ``deep_ep`` can be imported, without importing it (its import initialises CUDA and NCCL)."""
    if importlib.util.find_spec("deep_ep") is None:
        return False, "deep_ep is not importable: the reference (all_to_all_single over NCCL) runs"
    return True, ""


def dispatch_limits(x: torch.Tensor, deterministic: bool) -> Decision:
    """What the mapping needs of DeepEP's dispatch (``ElasticBuffer.dispatch``'s docstring and the
    deterministic epilogue)."""
    if x.dtype != torch.bfloat16:
        return False, f"DeepEP ElasticBuffer.dispatch takes x in bfloat16 (or an fp8 tuple), got {x.dtype}"
    if not deterministic:
        return False, ("DeepEP's rows arrive in arrival order unless ElasticBuffer(deterministic=True): the "
                       "contract's (source rank, token) order needs the deterministic epilogue")
    return True, ""


def expert_rows(recv_x: torch.Tensor, psum_num_recv_tokens_per_expert: torch.Tensor,
                num_unaligned_recv_tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand-mode recv_x [padded rows, H] -> (rows [R, H] expert-major without the alignment padding,
    counts int64 [L])."""
    counts = num_unaligned_recv_tokens_per_expert.to(torch.int64)
    psum = psum_num_recv_tokens_per_expert.to(torch.int64)
    if counts.shape != psum.shape or counts.dim() != 1:
        raise ValueError(f"num_unaligned_recv_tokens_per_expert: expected the shape of psum_num_recv_tokens_per_"
                         f"expert {tuple(psum.shape)} (1-D), got {tuple(counts.shape)}")
    starts = psum - counts  # [L]
    R = int(counts.sum())
    offsets = torch.arange(R, device=recv_x.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts,
                                                                              counts)
    index = torch.repeat_interleave(starts, counts) + offsets  # [R]
    if R and int(index.max()) >= recv_x.shape[0]:
        raise ValueError(f"psum_num_recv_tokens_per_expert: rows up to {int(index.max())} named, recv_x has "
                         f"{recv_x.shape[0]}")
    return recv_x[index], counts
