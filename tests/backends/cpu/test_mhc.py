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


def test_in_place_sinkhorn_is_bitwise_the_reference():
    from glm5_core.ops import mhc

    logits = torch.randn(33, 4, 4, generator=torch.Generator().manual_seed(6)) * 4
    for iters, eps in ((20, 1e-6), (1, 0.0), (3, 1e-3)):
        want = mhc.sinkhorn_reference(logits, iters=iters, eps=eps)
        assert torch.equal(cpu_mhc.sinkhorn_in_place(logits.clone(), iters=iters, eps=eps), want)
    wide = logits.double()
    want = mhc.sinkhorn_reference(wide, iters=5, eps=1e-6)
    assert torch.equal(cpu_mhc.sinkhorn_in_place(wide, iters=5, eps=1e-6), want)
    with torch.no_grad():  # the kernel without gradients: the in-place path, bf16 logits computed in fp32
        for x in (logits, logits.bfloat16()):
            assert torch.equal(cpu_mhc.sinkhorn(x, iters=20, eps=1e-6), mhc.sinkhorn_reference(x, iters=20, eps=1e-6))
