"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams around each block (GLM-5.3).

Mirrors transformers 5.25's ``Glm5NextTextHyperConnection`` / ``Glm5NextTextHyperHead``
(``models/glm5_next/modeling_glm5_next.py``): the same parameters under the same state-dict names (``fn``
[(2 + N) N, N D], ``base`` fp32 [(2 + N) N], ``scale`` fp32 [3]; the unweighted ``input_norm`` has none), the
same initialisation (``fn`` ~ N(0, 0.02), ``base`` 0, ``scale`` 1) and the same function.

Legend: L leading dims (batch, sequence), N = hc_mult streams, D hidden_size.

  flat  = unweighted_rmsnorm(streams.view(L, N D) in fp32) @ fn^T            [L, (2 + N) N]
  pre   = sigmoid(flat_pre * scale[0] + base_pre) + hc_eps                     [L, N]
  post  = 2 sigmoid(flat_post * scale[1] + base_post)                          [L, N]
  comb  = mhc.sinkhorn(flat_comb * scale[2] + base_comb, hc_sinkhorn_iters, hc_eps)   [L, N, N]
  block input = sum_i pre_i streams_i                                          [L, D]  (streams' dtype)
  streams after the block = mhc.mix(streams, block_out, post, comb)           [L, N, D]

The computation runs in fp32 (fp64 for fp64 streams, where transformers stays in fp32); the Sinkhorn
normalisation and the mix are ``glm5_core.ops.mhc`` calls, bound when the module is built.

Without gradients (inference: prefill, decode) the weights take a shorter path that computes the same bits
(:meth:`HyperConnection._weights_no_grad`): the three gate affines as one, in-place epilogues, and the bound
``mhc_sinkhorn`` kernel called without the entry point's checks (the cpu kernel then normalises in one native call,
or in place with torch ops without the extension: ``glm5_core/backends/cpu/mhc.py``; a decode step runs 2 sites x
layers of them on [B, N, N] matrices, where per-op overhead is all the cost).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm5_core import registry
from glm5_core.ops import _checks, mhc


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim (transformers' ``Glm5NextTextUnweightedRMSNorm``)."""
    ct = _checks.compute_dtype(x.dtype)
    return x * torch.rsqrt(x.to(ct).square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One mHC site (a layer has two: ``attn_hc`` and ``ffn_hc``). ``forward(streams [L, N, D])`` returns
    ``(post [L, N], comb [L, N, N], block_input [L, D])`` as transformers' module does; :meth:`mix` then
    combines the block's output with the streams."""

    def __init__(self, *, hidden_size: int, hc_mult: int, hc_sinkhorn_iters: int, hc_eps: float,
                 rms_norm_eps: float, backend: registry.BackendArg = None):
        super().__init__()
        self.hidden_size = _checks.positive_int("hidden_size", hidden_size)
        self.hc_mult = _checks.positive_int("hc_mult", hc_mult)
        self.hc_sinkhorn_iters = _checks.positive_int("hc_sinkhorn_iters", hc_sinkhorn_iters)
        self.hc_eps = _checks.positive_float("hc_eps", hc_eps, allow_zero=True)
        self.rms_norm_eps = _checks.positive_float("rms_norm_eps", rms_norm_eps, allow_zero=True)
        self.kernels = registry.bind(backend)  # resolved once, here
        n = self.hc_mult
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * self.hidden_size))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        # per device: which of the 3 scales each of the (2 + N) N columns takes (the no-grad path's one affine); a
        # plain attribute, not a buffer (checkpoint loading materialises buffers from the files)
        self._scale_of_column: dict[torch.device, torch.Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """transformers' ``_init_weights`` for the module: fn ~ N(0, 0.02), base 0, scale 1."""
        with torch.no_grad():
            nn.init.normal_(self.fn, mean=0.0, std=0.02)
            nn.init.zeros_(self.base)
            nn.init.ones_(self.scale)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [L, N], post [L, N], comb [L, N, N]) in the compute dtype, from streams [L, N, D]."""
        n, d = self.hc_mult, self.hidden_size
        if streams.dim() < 3 or tuple(streams.shape[-2:]) != (n, d):
            raise ValueError(f"streams: expected [..., hc_mult={n}, hidden_size={d}], got shape "
                             f"{tuple(streams.shape)}")
        lead = streams.shape[:-2]
        ct = _checks.compute_dtype(streams.dtype)
        if not (torch.is_grad_enabled() and (streams.requires_grad or self.fn.requires_grad
                                             or self.base.requires_grad or self.scale.requires_grad)):
            return self._weights_no_grad(streams, lead, ct)
        flat = unweighted_rms_norm(streams.reshape(*lead, n * d).to(ct), self.rms_norm_eps)
        flat = F.linear(flat, self.fn.to(ct))  # [L, (2 + N) N]
        pre_w, post_w, comb_w = flat.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.to(ct).split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.to(ct).unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        logits = comb_w.reshape(*lead, n, n) * comb_s + comb_b.view(n, n)
        comb = mhc.sinkhorn(logits.reshape(-1, n, n), iters=self.hc_sinkhorn_iters, eps=self.hc_eps,
                            backend=self.kernels).view(*lead, n, n)
        return pre, post, comb

    def _weights_no_grad(self, streams: torch.Tensor, lead: torch.Size, ct: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`weights` without gradients, the same bits in fewer ops: every column's ``flat * scale + base``
        at once (the elementwise products and sums the three separate affines compute), in-place epilogues, and
        the bound Sinkhorn kernel called without the entry point's checks."""
        n, d = self.hc_mult, self.hidden_size
        x = _checks.cast(streams.reshape(-1, n * d), ct)  # [R, N D]
        r = x.square().mean(-1, keepdim=True)  # [R, 1]
        flat = F.linear(x * r.add_(self.rms_norm_eps).rsqrt_(), _checks.cast(self.fn, ct))  # [R, (2 + N) N]
        column = self._scale_of_column.get(flat.device)
        if column is None:
            column = torch.tensor([0] * n + [1] * n + [2] * n * n, device=flat.device)
            self._scale_of_column[flat.device] = column
        flat.mul_(_checks.cast(self.scale, ct).index_select(0, column)).add_(_checks.cast(self.base, ct))
        # [R, N] each, sigmoids over contiguous copies as the separate affines' outputs are (torch's vectorised and
        # scalar exp round differently: over a strided slice some values would come out another way)
        pre = flat[:, :n].contiguous().sigmoid_().add_(self.hc_eps)
        post = flat[:, n:2 * n].contiguous().sigmoid_().mul_(2)
        logits = flat[:, 2 * n:].reshape(-1, n, n)
        # straight to the bound kernel, as in mix (the module builds the shapes the entry point would check); the
        # cpu kernel normalises in place without gradients
        comb = registry.call("mhc_sinkhorn", logits, iters=self.hc_sinkhorn_iters, eps=self.hc_eps,
                             backend=self.kernels)
        return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [L, N, D] -> (post [L, N], comb [L, N, N], block input [L, D] in the streams' dtype)."""
        pre, post, comb = self.weights(streams)
        collapsed = _checks.cast((pre.unsqueeze(-1) * streams).sum(dim=-2), streams.dtype)
        return post, comb, collapsed

    def mix(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
        """The streams after the block: ``post``-weighted copies of block_out [L, D] plus the ``comb``-mixed
        input streams [L, N, D] (transformers' decoder layer's ``post * out + comb^T @ residual``)."""
        n, d = self.hc_mult, self.hidden_size
        lead = streams.shape[:-2]
        # the op's entry point checks shapes that this module builds itself: straight to the bound kernel (twice a
        # layer per decode step, where the checks cost as much as the kernel)
        out = registry.call("mhc_mix", streams.reshape(-1, n, d), _checks.cast(block_out.reshape(-1, d), streams.dtype),
                            post.reshape(-1, n), comb.reshape(-1, n, n), backend=self.kernels)
        return out.view(*lead, n, d)


class HyperHead(nn.Module):
    """The final collapse of the ``hc_mult`` streams: their unweighted mean (GLM-5.3-Flash; no parameters)."""

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [L, N, D] -> [L, D]."""
        return streams.mean(dim=-2)
