"""GLM-5.3's clamped SwiGLU on the cpu backend's native experts kernels: forward and the native backward (the
clamps' gradients, values exactly at +-L included) against the reference, fp64 and fp32."""
from __future__ import annotations

import pytest
import torch

from tests.ops import swiglu_limit_cases as cases


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("op", ["moe_fused_experts", "moe_experts"])
def test_clamped_experts_kernel(op, dtype, tol, native):
    if op == "moe_experts":  # the native unfused experts kernel is forward-only: check the forward there
        from glm5_core.ops import moe

        x = cases.sorted_inputs(cases.inputs(dtype))
        with torch.no_grad():
            got = moe.experts(**x, swiglu_limit=cases.LIMIT, backend="cpu")
        want = moe.experts_reference(**x, swiglu_limit=cases.LIMIT)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        return
    cases.check_backend(op, "cpu", dtype, tol=tol)
