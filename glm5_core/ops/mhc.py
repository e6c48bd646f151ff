"""Manifold-constrained hyper-connections (mHC): the Sinkhorn-normalised mixing of ``N = hc_mult`` residual
streams (GLM-5.3, DeepSeek-V4; transformers' ``Glm5NextTextHyperConnection``).

A family of its own: none of the attention (mla, dsa), expert (moe, ep) or optimizer (muon) families holds the
residual-stream plumbing, and its checks (a doubly stochastic matrix, the mix of streams) share nothing with
theirs.

The ops of this family (``OPS`` declares them):

``mhc_sinkhorn`` (entry point :func:`sinkhorn`, reference :func:`sinkhorn_reference`): per row, the ``N x N``
mixing logits become a (near) doubly stochastic matrix, exactly as transformers computes ``comb``::

    C = softmax(logits, dim=-1) + eps
    C = C / (colsum(C) + eps)                       # colsum: the sum over dim -2
    repeat iters - 1 times:
        C = C / (rowsum(C) + eps);  C = C / (colsum(C) + eps)

``mhc_mix`` (entry point :func:`mix`, reference :func:`mix_reference`): the streams after a block::

    out[r, j, :] = post[r, j] * block_out[r, :] + sum_i comb[r, i, j] * residual[r, i, :]

(transformers: ``post[..., None] * block_out[..., None, :] + comb^T @ residual``).

Legend: R rows (tokens, leading dims flattened), N streams, D hidden size. Both compute in fp32 (fp64 for fp64
inputs); ``mhc_sinkhorn`` returns the compute dtype (as transformers' fp32 ``comb``), ``mhc_mix`` the residual
stream's dtype. Both are differentiable.
"""
from __future__ import annotations

import torch

from glm5_core import registry
from glm5_core.ops import _checks
from glm5_core.opspec import OpSpec


def sinkhorn_reference(logits: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """[R, N, N] logits -> [R, N, N] comb in the compute dtype (see the module docstring)."""
    comb = torch.softmax(logits.to(_checks.compute_dtype(logits.dtype)), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mix_reference(residual: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
    """residual [R, N, D], block_out [R, D], post [R, N], comb [R, N, N] -> [R, N, D] in residual's dtype."""
    ct = _checks.compute_dtype(residual.dtype)
    out = post.to(ct).unsqueeze(-1) * block_out.to(ct).unsqueeze(-2)  # [R, N, D]
    out = out + torch.matmul(comb.to(ct).transpose(-1, -2), residual.to(ct))  # [R, N, D]
    return out.to(residual.dtype)


OPS = (
    OpSpec("mhc_sinkhorn", sinkhorn_reference, family="mhc", differentiable=True),
    OpSpec("mhc_mix", mix_reference, family="mhc", differentiable=True),
)


def sinkhorn(logits: torch.Tensor, *, iters: int, eps: float, backend: registry.BackendArg = None) -> torch.Tensor:
    """The Sinkhorn-normalised mixing matrices of ``logits [R, N, N]`` (``iters`` >= 1 as transformers'
    ``hc_sinkhorn_iters``, ``eps`` >= 0 its ``hc_eps``). Returns [R, N, N] in fp32 (fp64 for fp64 logits)."""
    _checks.tensor("logits", logits, dims=(None, "N", "N"), sizes={}, legend="[R, N, N]")
    _checks.positive_int("iters", iters)
    eps = _checks.positive_float("eps", eps, allow_zero=True)
    return registry.call("mhc_sinkhorn", logits, iters=iters, eps=eps, backend=backend)


def mix(residual: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
        backend: registry.BackendArg = None) -> torch.Tensor:
    """The ``N`` streams after a block: ``post``-weighted copies of ``block_out`` plus the ``comb``-mixed input
    streams. residual [R, N, D], block_out [R, D], post [R, N], comb [R, N, N] -> [R, N, D] (residual's dtype)."""
    sizes: dict[str, int] = {}
    _checks.tensor("residual", residual, dims=("R", "N", "D"), sizes=sizes, legend="[R, N, D]")
    _checks.tensor("block_out", block_out, dims=("R", "D"), sizes=sizes, legend="[R, D]")
    _checks.tensor("post", post, dims=("R", "N"), sizes=sizes, legend="[R, N]")
    _checks.tensor("comb", comb, dims=("R", "N", "N"), sizes=sizes, legend="[R, N, N]")
    _checks.same_dtype(residual=residual, block_out=block_out)
    _checks.same_device(residual=residual, block_out=block_out, post=post, comb=comb)
    return registry.call("mhc_mix", residual, block_out, post, comb, backend=backend)
