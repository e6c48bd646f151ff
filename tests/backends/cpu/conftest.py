"""Fixtures of the native CPU kernel tests.

``native`` builds (first use) and returns the extension status. With ``GLM5_SKIP_EXT=1`` the native
tests skip (the fallback itself is tested in ``test_build.py``); otherwise a failed build FAILS them,
so CI cannot pass silently on the reference.
"""
import os

import pytest
import torch


@pytest.fixture(scope="session")
def native():
    from glm5_core.backends.cpu import backend

    status = backend.status()
    if os.environ.get("GLM5_SKIP_EXT", "0") not in ("", "0"):
        pytest.skip("GLM5_SKIP_EXT=1: native CPU extension skipped")
    assert status.built, status.describe()
    return status


@pytest.fixture
def threads():
    """Restore the intra-op thread count after a test changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
