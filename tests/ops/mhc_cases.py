"""mHC op cases shared by the backend tests: a backend's kernels (no reference fallback) against the references,
forward and backward, at odd sizes and stream counts."""
from __future__ import annotations

import torch

from glm5_core import registry
from glm5_core.ops import mhc

SINKHORN_CASES = ((7, 4, 20), (5, 3, 1), (3, 1, 2), (19, 5, 3))  # (R, N, iters)
MIX_CASES = ((6, 4, 37), (3, 1, 5), (5, 3, 130))  # (R, N, D)


def _grads(fn, inputs, cotangent_seed=3):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    out = fn(**leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(cotangent_seed)).to(out.device)
    torch.autograd.backward(out, g.to(out.dtype))
    return out, {k: v.grad for k, v in leaves.items()}


def check_sinkhorn(backend: str, device: str = "cpu", tol: float = 2e-5) -> None:
    for R, N, iters in SINKHORN_CASES:
        logits = (torch.randn(R, N, N, generator=torch.Generator().manual_seed(R)) * 3).to(device)
        with registry.record_reference_runs() as log:
            out, grads = _grads(lambda it=iters, **t: mhc.sinkhorn(**t, iters=it, eps=1e-6, backend=backend),
                                {"logits": logits})
        assert not log, log
        want, want_grads = _grads(lambda it=iters, **t: mhc.sinkhorn_reference(**t, iters=it, eps=1e-6),
                                  {"logits": logits})
        assert out.dtype == want.dtype
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
        torch.testing.assert_close(grads["logits"], want_grads["logits"], rtol=tol, atol=tol)


def check_mix(backend: str, device: str = "cpu", dtype=torch.float32, tol: float = 2e-5) -> None:
    for R, N, D in MIX_CASES:
        g = torch.Generator().manual_seed(R + N)
        x = dict(residual=torch.randn(R, N, D, generator=g).to(dtype),
                 block_out=torch.randn(R, D, generator=g).to(dtype),
                 post=torch.rand(R, N, generator=g), comb=torch.rand(R, N, N, generator=g))
        x = {k: v.to(device) for k, v in x.items()}
        with registry.record_reference_runs() as log:
            out, grads = _grads(lambda **t: mhc.mix(**t, backend=backend), x)
        assert not log, log
        want, want_grads = _grads(mhc.mix_reference, x)
        assert out.dtype == want.dtype == dtype
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
        for k in x:
            assert grads[k].dtype == x[k].dtype
            torch.testing.assert_close(grads[k].float(), want_grads[k].float(), rtol=tol, atol=tol,
                                       msg=lambda m, k=k: f"d{k}: {m}")
