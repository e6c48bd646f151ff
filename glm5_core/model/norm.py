"""RMSNorm (the model's norms; k_norm of the indexer is a torch LayerNorm with bias)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xc = x.to(compute)
        xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xc.to(x.dtype)
