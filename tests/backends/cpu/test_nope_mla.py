"""NoPE MLA (qk_rope_head_dim = 0) on the cpu backend's kernels: every MLA / sparse-MLA op with a native (or
torch-fused) kernel runs it, not the reference, and matches the reference forward and backward."""
from __future__ import annotations

import pytest
import torch

from tests.ops import nope_cases

# ops whose cpu kernel exists (mla_decode keeps the reference by choice: REFERENCE_BY_CHOICE)
KERNEL_OPS = ("mla_prefill", "dsa_sparse_prefill", "dsa_sparse_decode", "dsa_sparse_prefill_expanded",
              "dsa_selected_attention_target")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_kernel_runs_and_matches_reference_without_rope(op, dtype, native):
    (out, grads), (ref, ref_grads), ran = nope_cases.run(op, "cpu", dtype, "cpu")
    assert ran, f"{op}: the reference ran instead of the cpu kernel"
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], **tol, msg=lambda m, k=k: f"d{k}: {m}")
