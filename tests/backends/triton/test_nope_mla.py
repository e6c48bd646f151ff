"""NoPE MLA (qk_rope_head_dim = 0) on the Triton kernels: sparse prefill (forward + backward), sparse decode,
dense decode and the indexer-KL target run with an empty rope slice and match the reference (the sparse
backward used to fail reshaping the empty rope-key gradient)."""
from __future__ import annotations

import pytest
import torch

from tests.backends.triton.helpers import assert_close
from tests.ops import nope_cases

KERNEL_OPS = ("mla_decode", "dsa_sparse_prefill", "dsa_sparse_decode", "dsa_selected_attention_target")


@pytest.mark.parametrize("op", KERNEL_OPS)
def test_kernel_runs_and_matches_reference_without_rope(op, device):
    (out, grads), (ref, ref_grads), ran = nope_cases.run(op, "cuda", torch.float32, device)
    assert ran, f"{op}: the reference ran instead of the Triton kernel"
    assert_close(out, ref, torch.float32, op)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        if grads[k].numel():
            assert_close(grads[k], ref_grads[k], torch.float32, f"{op} d{k}")
