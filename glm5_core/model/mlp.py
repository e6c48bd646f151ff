"""SwiGLU feed-forward: the dense layers' MLP, each routed expert and the shared experts.

``swiglu_limit`` L (GLM-5.3): the clamped SwiGLU of transformers' ``Glm5NextTextMLP``, silu(min(gate, L)) *
clamp(up, -L, L) (``glm5_core.ops.moe.swiglu``); None (the default) is the plain SwiGLU, computed as before."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from glm5_core.ops import _checks
from glm5_core.ops.moe import swiglu


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: Optional[float] = None):
        super().__init__()
        self.swiglu_limit = None if swiglu_limit is None else _checks.positive_float("swiglu_limit", swiglu_limit)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
