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


def _sinkhorn_cases():
    """(logits, iters, eps): odd row counts, N = 1..5, iters 1 / 3 / 20, eps 0 and 1e-6, fp32 / fp64 / bf16 logits
    (spread wide enough that rows, columns and the softmax all differ from uniform)."""
    for N in range(1, 6):
        for R, dtype in ((1, torch.float32), (33, torch.float32), (3, torch.float64), (7, torch.bfloat16)):
            logits = (torch.randn(R, N, N, generator=torch.Generator().manual_seed(R * 10 + N)) * 4).to(dtype)
            for iters, eps in ((1, 0.0), (3, 1e-6), (20, 1e-6), (20, 0.0)):
                yield logits, iters, eps


def test_no_grad_sinkhorn_is_bitwise_the_reference_native_or_not():
    """The kernel without gradients (the native normalisation where the extension is built and N <= 4, the
    in-place torch steps otherwise) against the reference, bit for bit."""
    from glm5_core.ops import mhc

    with torch.no_grad():
        for logits, iters, eps in _sinkhorn_cases():
            want = mhc.sinkhorn_reference(logits, iters=iters, eps=eps)
            got = cpu_mhc.sinkhorn(logits, iters=iters, eps=eps)
            assert got.dtype == want.dtype and torch.equal(got, want), (tuple(logits.shape), logits.dtype, iters, eps)


def test_native_sinkhorn_normalize_is_bitwise_the_reference(native, threads):
    """The native op itself (after torch's softmax) for N <= 4, at 1 and 2 threads with rows enough to split."""
    from glm5_core.ops import mhc

    cases = [c for c in _sinkhorn_cases() if c[0].shape[-1] <= cpu_mhc.NATIVE_MAX_N]
    cases.append((torch.randn(1001, 4, 4, generator=torch.Generator().manual_seed(3)) * 4, 20, 1e-6))
    for n in (1, 2):
        torch.set_num_threads(n)
        for logits, iters, eps in cases:
            p = torch.softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)
            got = torch.ops.glm5_cpu.mhc_sinkhorn_normalize(p, iters, eps)
            want = mhc.sinkhorn_reference(logits, iters=iters, eps=eps)
            assert torch.equal(got, want), (n, tuple(logits.shape), logits.dtype, iters, eps)


def test_native_sinkhorn_is_used_without_gradients_only(native, monkeypatch):
    """Without gradients the kernel calls the native op for N <= 4 (and not for N = 5); with gradients it keeps the
    autograd path (a gradient comes back)."""
    calls = []
    op = torch.ops.glm5_cpu.mhc_sinkhorn_normalize

    class _Spy:
        def mhc_sinkhorn_normalize(self, *args):
            calls.append(args[0].shape[-1])
            return op(*args)

    monkeypatch.setattr(torch.ops, "glm5_cpu", _Spy())
    with torch.no_grad():
        cpu_mhc.sinkhorn(torch.randn(2, 4, 4), iters=3, eps=1e-6)
        cpu_mhc.sinkhorn(torch.randn(2, 5, 5), iters=3, eps=1e-6)
    logits = torch.randn(2, 4, 4, requires_grad=True)
    cpu_mhc.sinkhorn(logits, iters=3, eps=1e-6).sum().backward()
    assert calls == [4] and logits.grad is not None
