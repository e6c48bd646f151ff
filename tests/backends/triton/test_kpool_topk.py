"""The k-pool indexer top-k on the Triton backend (the indexer top-k kernel with POOL = kpool): the reference's
indices, prefill = decode and ragged rows bitwise."""
from __future__ import annotations

from tests.ops import kpool_cases


def test_kpool_topk_kernel(device):
    kpool_cases.check_backend("cuda", device=device)
