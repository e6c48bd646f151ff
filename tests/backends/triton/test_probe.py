"""The cuda / rocm probes refuse the interpreter when triton was imported before TRITON_INTERPRET=1."""
import sys
import types

import pytest

from glm5_core import registry


def test_probe_reports_a_late_interpreter_switch(monkeypatch):
    JITFunction = type("JITFunction", (), {})  # what triton.language helpers are when compiled, not interpreted
    monkeypatch.setitem(sys.modules, "triton.language.standard", types.SimpleNamespace(zeros=JITFunction()))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("cuda", "rocm"):
        ok, why = registry.get_backend(name).available()
        assert not ok and "after triton was imported" in why


def test_probe_accepts_the_interpreter_when_set_first(monkeypatch, device):
    if device != "cpu":
        pytest.skip("on a GPU the kernels are compiled, not interpreted")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # conftest imported triton.language under the interpreter
    ok, why = registry.get_backend("cuda").available()
    assert ok and "interpreter" in why
