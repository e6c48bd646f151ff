"""Shared pytest configuration.

Backends under test: ``GLM5_TEST_BACKENDS`` (comma-separated), else ``GLM5_BACKEND``, else every backend
available here (on a machine without a GPU that includes cuda and rocm under ``TRITON_INTERPRET=1``).
A named backend that is unavailable is skipped with its reason, never an error, so
``GLM5_BACKEND=ascend pytest`` on a machine without NPUs skips the Ascend checks.
"""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, check the cuda / rocm Triton kernels on CPU tensors through Triton's interpreter. This must
# happen before anything imports triton (Triton fixes interpreter-or-compiler at import).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() and importlib.util.find_spec("triton"):
    os.environ["TRITON_INTERPRET"] = "1"

from glm5_core import registry  # noqa: E402


def backends_under_test():
    named = os.environ.get("GLM5_TEST_BACKENDS") or os.environ.get("GLM5_BACKEND")
    if named and named != "auto":
        return [n.strip() for n in named.split(",") if n.strip()]
    return [name for name, be in registry.backends().items() if be.available()[0]]


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", backends_under_test(), indirect=True)


@pytest.fixture
def backend(request):
    name = request.param
    try:
        be = registry.get_backend(name)
    except ValueError as exc:
        pytest.skip(str(exc))
    ok, reason = be.available()
    if not ok:
        pytest.skip(f"{name} unavailable: {reason}")
    return name


@pytest.fixture(autouse=True)
def _no_ambient_backend(monkeypatch, request):
    """Tests pick their backend explicitly; an ambient GLM5_BACKEND must not redirect reference tests."""
    if "backend" not in request.fixturenames:
        monkeypatch.delenv("GLM5_BACKEND", raising=False)
    monkeypatch.delenv("GLM5_STRICT", raising=False)


@pytest.fixture
def spawnable_test_modules(monkeypatch):
    """Processes started by the 'spawn' method unpickle their target by module name (``tests.optim...``).
    Under ``--import-mode=importlib`` and the ``pytest`` console script the repository root is not on
    ``sys.path``, so put it there: spawned children inherit the parent's ``sys.path``."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
