"""mHC on the Triton kernels: Sinkhorn (the backward walking the kept iterates back) and the stream mix against
the references, forward and backward, at odd sizes and stream counts (1, 3, 4, 5), fp32 and bf16 streams."""
from __future__ import annotations

import torch

from tests.ops import mhc_cases


def test_sinkhorn_kernel(device):
    mhc_cases.check_sinkhorn("cuda", device)


def test_mix_kernel(device):
    mhc_cases.check_mix("cuda", device)
    mhc_cases.check_mix("cuda", device, dtype=torch.bfloat16, tol=2e-2)
