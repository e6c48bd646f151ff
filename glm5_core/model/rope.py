"""Rotary position embedding on the rope slice of queries and keys.

Legend: B batch, T tokens, H heads, R rotary width (even), R/2 rotated pairs.

``interleave=True`` (GLM-5) rotates adjacent pairs (x[2i], x[2i+1]); ``False`` rotates the halves
(x[i], x[i + R/2]). Both rotate pair i by the angle ``position * theta^(-2i/R)``.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import nn

StartPos = Union[int, torch.Tensor]


def positions_of(start_pos: StartPos, batch: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Absolute positions int64 [B, T] of ``num_tokens`` tokens starting at ``start_pos`` (int or [B])."""
    offsets = torch.arange(num_tokens, device=device, dtype=torch.int64)  # [T]
    if isinstance(start_pos, torch.Tensor):
        return start_pos.to(device=device, dtype=torch.int64).view(batch, 1) + offsets  # [B, T]
    return (offsets + start_pos).unsqueeze(0).expand(batch, num_tokens)  # [B, T]


class RotaryEmbedding(nn.Module):
    """cos / sin tables [B, T, R/2] for given positions (computed on the fly, nothing cached)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim  # [R/2]
        self.register_buffer("inv_freq", theta ** (-exponents), persistent=False)  # fp64 [R/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        angles = positions.to(angle_dtype).unsqueeze(-1) * self.inv_freq.to(angle_dtype)  # [B, T, R/2]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """Rotate x [B, T, R] or [B, T, H, R] by the angles whose cos / sin are [B, T, R/2]."""
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, R/2]
    if interleave:
        even, odd = x[..., 0::2], x[..., 1::2]  # [..., R/2] each
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # [..., R/2, 2]
        return rotated.flatten(-2)  # [..., R]
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
