"""Rotary position embedding on the rope slice of queries and keys.

Legend: B batch, T tokens, H heads, R rotary width (even), R/2 rotated pairs.

``interleave=True`` (GLM-5) rotates adjacent pairs (x[2i], x[2i+1]); ``False`` rotates the halves
(x[i], x[i + R/2]). Both rotate pair i by the angle ``position * theta^(-2i/R)``.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import nn

StartPos = Union[int, torch.Tensor]


def positions_of(start_pos: StartPos, batch: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Absolute positions int64 [B, T] of ``num_tokens`` tokens starting at ``start_pos`` (int or [B])."""
    offsets = torch.arange(num_tokens, device=device, dtype=torch.int64)  # [T]
    if isinstance(start_pos, torch.Tensor):
        return start_pos.to(device=device, dtype=torch.int64).view(batch, 1) + offsets  # [B, T]
    return (offsets + start_pos).unsqueeze(0).expand(batch, num_tokens)  # [B, T]


def inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i/R) for the R/2 pairs, fp64 [R/2]."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim  # [R/2]
    return theta ** (-exponents)


class RotaryEmbedding(nn.Module):
    """cos / sin tables [B, T, R/2] for given positions (computed on the fly, nothing cached)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        self.register_buffer("inv_freq", inverse_frequencies(rotary_dim, theta), persistent=False)  # fp64 [R/2]

    def _apply(self, fn, recurse=True):
        """Module.to / .half() / .bfloat16() move inv_freq but never below fp32. The angle is position *
        inv_freq: a bf16 inv_freq (relative error up to 2^-9) would turn pair i at position p by up to
        p * inv_freq[i] * 2^-9 radians too far, which is far off within the model's context."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype not in (torch.float32, torch.float64):
            exact = inverse_frequencies(self.rotary_dim, self.theta).to(torch.float32)
            self.inv_freq = exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        angles = positions.to(angle_dtype).unsqueeze(-1) * self.inv_freq.to(angle_dtype)  # [B, T, R/2]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """Rotate x [B, T, R] or [B, T, H, R] by the angles whose cos / sin are [B, T, R/2].

    Written on whole rows: ``x * cos_R + partner(x) * signed_sin_R``, where partner swaps each rotated pair
    (x[2i] <-> x[2i+1], or the two halves) and signed_sin_R is -sin at a pair's first member and +sin at its
    second. Every output element is then the same two rounded products and one rounded sum as the textbook
    ``first * cos - second * sin`` / ``first * sin + second * cos`` (negation is exact and a + (-b) is a - b),
    bitwise, in every dtype; and so are the gradients autograd derives (two-term sums, order-free). No strided
    half-width slices and no interleaving stack: a few contiguous passes, forward and backward."""
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, R/2]
    if interleave:
        cos_r = torch.stack((cos, cos), dim=-1).flatten(-2)  # [..., R]: c0 c0 c1 c1 ...
        signed_sin = torch.stack((-sin, sin), dim=-1).flatten(-2)  # [..., R]: -s0 s0 -s1 s1 ...
        pairs = x.view(*x.shape[:-1], x.shape[-1] // 2, 2)  # [..., R/2, 2]
        partner = pairs.flip(-1).flatten(-2)  # [..., R]: x1 x0 x3 x2 ...
    else:
        cos_r = torch.cat((cos, cos), dim=-1)  # [..., R]
        signed_sin = torch.cat((-sin, sin), dim=-1)  # [..., R]
        half = x.shape[-1] // 2
        partner = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [..., R]: second half, then first
    return x * cos_r + partner * signed_sin
