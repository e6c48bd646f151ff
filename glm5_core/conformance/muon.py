"""Conformance checks of the Muon family (``glm5_core.ops.muon``): Newton-Schulz orthogonalization against the
reference at the same compute dtype and the fp64 iteration."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from glm5_core import testing
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn
from glm5_core.ops import muon


def _muon_check(shape: Sequence[int], dtype: torch.dtype, coefficients: str,
                compute_dtype: torch.dtype = torch.float32) -> CheckFn:
    """Against the reference at the same compute dtype and the fp64 iteration: with bf16 compute the kernel
    may be at most ERROR_FACTOR times as far from the fp64 result as the bf16-compute reference is."""
    def fn(backend: str, device: str) -> testing.Comparison:
        G = testing.make_muon_input(shape, dtype=dtype, device=device, seed=13)
        out = muon.orthogonalize(G, steps=5, coefficients=coefficients, compute_dtype=compute_dtype, backend=backend)
        schedule = muon.coefficients_for(coefficients)
        ref = muon.orthogonalize_reference
        cmp = testing.compare_to_fp64(out, ref(G, steps=5, coefficients=schedule, compute_dtype=compute_dtype),
                                      ref(G.double(), steps=5, coefficients=schedule), dtype)
        cmp.detail += f"; orthogonality error max|sigma - 1| = {testing.orthogonality_error(out):.3g}"
        return cmp

    return fn


def _muon_name(shape: Sequence[int], dtype: torch.dtype, coefficients: str, suffix: str = "") -> str:
    return f"muon_orthogonalize[{DTYPE_NAMES[dtype]}-{'x'.join(map(str, shape))}-{coefficients}{suffix}]"


def checks() -> list[Check]:
    fp32_compute = [Check("muon", _muon_name(shape, dtype, coef), ("muon_orthogonalize",),
                          _muon_check(shape, dtype, coef))
                    for shape in testing.MUON_SHAPES for dtype in testing.FLOAT_DTYPES_UNDER_TEST
                    for coef in ("jordan", "polar_express")]
    bf16_compute = [Check("muon", _muon_name(shape, dtype, "polar_express", "-bf16_compute"), ("muon_orthogonalize",),
                          _muon_check(shape, dtype, "polar_express", torch.bfloat16))
                    for shape in testing.MUON_SHAPES for dtype in (torch.float32, torch.bfloat16)]
    return fp32_compute + bf16_compute

