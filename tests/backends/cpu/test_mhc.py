"""mHC on the cpu backend (torch-op kernels with hand-written backwards): Sinkhorn and the stream mix against the
references, forward and backward, fp32 and fp64; gradcheck of the hand-written backwards (fp64)."""
from __future__ import annotations

import torch

from glm5_core.backends.cpu import mhc as cpu_mhc
from tests.ops import mhc_cases


def test_sinkhorn_kernel():
    mhc_cases.check_sinkhorn("cpu")


def test_mix_kernel():
    mhc_cases.check_mix("cpu")
    mhc_cases.check_mix("cpu", dtype=torch.float64, tol=1e-12)


def test_hand_written_backwards_gradcheck():
    logits = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: cpu_mhc.sinkhorn(t, iters=3, eps=1e-6), (logits,))
    x = [torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True),
         torch.randn(2, 5, dtype=torch.float64, requires_grad=True),
         torch.rand(2, 3, dtype=torch.float64, requires_grad=True),
         torch.rand(2, 3, 3, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(cpu_mhc.mix, tuple(x))
