"""Conformance checks of the mHC family (``glm5_core.ops.mhc``): the Sinkhorn normalisation and the stream mix
against the reference (and the fp64 reference) at odd sizes and a few stream counts, the Sinkhorn output's
column sums, and the backward inputs of both ops."""
from __future__ import annotations

from typing import Callable

import torch

from glm5_core import registry, testing
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn, GradCase, fp64
from glm5_core.ops import mhc

# (rows R, streams N, hidden D, Sinkhorn iterations): odd sizes, N = 4 as GLM-5.3, one stream, a 1-iteration run
MHC_SHAPES = ((37, 4, 24, 20), (5, 3, 9, 3), (3, 1, 5, 1))


def _inputs(R: int, N: int, D: int, dtype: torch.dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    return {"residual": testing.randn((R, N, D), seed=seed, dtype=dtype, device=device),
            "block_out": testing.randn((R, D), seed=seed + 1, dtype=dtype, device=device),
            "post": 2 * torch.sigmoid(testing.randn((R, N), seed=seed + 2, device=device)),
            "comb": mhc.sinkhorn_reference(testing.randn((R, N, N), seed=seed + 3, device=device), iters=5,
                                           eps=1e-6)}


def _sinkhorn_check(R: int, N: int, iters: int, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        logits = testing.randn((R, N, N), seed=5, dtype=dtype, device=device, scale=3.0)
        out = mhc.sinkhorn(logits, iters=iters, eps=1e-6, backend=backend)
        ref = registry.reference("mhc_sinkhorn")
        cmp = testing.compare_to_fp64(out, ref(logits, iters=iters, eps=1e-6),
                                      ref(logits.double(), iters=iters, eps=1e-6), torch.float32)
        cols = float((out.double().sum(-2) - 1).abs().max())  # the last step normalises the columns
        if cols > 1e-4 * N:
            return testing.Comparison(False, cols, 1e-4 * N, f"column sums off 1 by {cols:.3g}")
        return cmp

    return fn


def _mix_check(R: int, N: int, D: int, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = _inputs(R, N, D, dtype, device, seed=7)
        out = mhc.mix(**x, backend=backend)
        ref = registry.reference("mhc_mix")
        return testing.compare_to_fp64(out, ref(**x), ref(**fp64(x)), dtype)

    return fn


def checks() -> list[Check]:
    out = []
    for R, N, D, iters in MHC_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            out.append(Check("mhc", f"mhc_sinkhorn[{DTYPE_NAMES[dtype]}-R{R}-N{N}-iters{iters}]", ("mhc_sinkhorn",),
                             _sinkhorn_check(R, N, iters, dtype)))
        for dtype in (torch.float32, torch.bfloat16):
            out.append(Check("mhc", f"mhc_mix[{DTYPE_NAMES[dtype]}-R{R}-N{N}-D{D}]", ("mhc_mix",),
                             _mix_check(R, N, D, dtype)))
    return out


def _sinkhorn_grad(device: str) -> GradCase:
    logits = testing.randn((7, 4, 4), seed=11, device=device, scale=2.0)
    return (lambda be, **t: mhc.sinkhorn(**t, iters=6, eps=1e-6, backend=be),
            lambda **t: mhc.sinkhorn_reference(**t, iters=6, eps=1e-6), {"logits": logits})


def _mix_grad(device: str) -> GradCase:
    x = _inputs(9, 3, 13, torch.float32, device, seed=13)
    return (lambda be, **t: mhc.mix(**t, backend=be), lambda **t: mhc.mix_reference(**t), x)


GRAD_CASES: dict[str, Callable[[str], GradCase]] = {"mhc_sinkhorn": _sinkhorn_grad, "mhc_mix": _mix_grad}
BF16_GRAD_OPS = ("mhc_mix",)
