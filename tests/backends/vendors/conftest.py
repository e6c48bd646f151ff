"""Fixtures of the vendor-stack tests: a clean registry and clean probe caches around each test (the stacks are
simulated by ``glm5_core.backends.simulated``, which restores torch and forgets the probes' answers on exit)."""
import pytest

from glm5_core import registry
from glm5_core.backends import simulated

NEW_VENDORS = ("musa", "mlu", "gcu", "kunlunxin", "metax", "hygon")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the device probes decide, not the interpreter
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    monkeypatch.delenv("GLM5_STRICT", raising=False)
    simulated.forget_probes()
    registry.reset()
    yield
    simulated.forget_probes()
    registry.reset()
