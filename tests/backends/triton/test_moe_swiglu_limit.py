"""GLM-5.3's clamped SwiGLU in the Triton grouped experts (CLAMP constexpr): forward and backward (the clamps'
gradients, values exactly at +-L included) against the reference."""
from __future__ import annotations

import torch

from tests.ops import swiglu_limit_cases as cases


def test_clamped_experts_kernel(device):
    cases.check_backend("moe_experts", "cuda", torch.float32, device, tol=2e-5)
