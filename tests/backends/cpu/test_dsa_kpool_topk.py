"""The k-pool indexer top-k on the cpu backend (the native indexer top-k with pool = kpool): the reference's
indices, prefill = decode and ragged rows bitwise, fp32 and fp64."""
from __future__ import annotations

import pytest
import torch

from tests.ops import kpool_cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_kpool_topk_kernel(dtype, native):
    kpool_cases.check_backend("cpu", dtype)
