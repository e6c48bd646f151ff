"""The benchmark scripts under test, each loaded as a fresh module, and the checks every kernel benchmark
(a kernel timed against its reference) must pass. Not collected itself (not test_*.py)."""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from glm5_core import registry

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(monkeypatch, name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module of its own (``<name>_under_test``)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their folder's _results
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def exits_2_naming(bench: ModuleType, capsys, flags, named: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(flags)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_without_the_kernel_it_exits_1(bench: ModuleType, monkeypatch, capsys, tmp_path, request) -> None:
    """It refuses to time the reference against itself. A test of every kernel benchmark: its test module imports
    it and names the op it times in ``OP``."""
    monkeypatch.setattr(registry, "runs_reference", lambda op, backend: True)
    assert bench.main(["--out", str(tmp_path / "r.json")]) == 1
    assert f"runs the reference for {request.module.OP}" in capsys.readouterr().err


def prepare_a_tiny_run(monkeypatch, op: str) -> None:
    """Skip where ``op``'s cpu kernel is not built; keep this process's thread count as it is."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    if registry.runs_reference(op, "cpu"):
        pytest.skip("the cpu extension is not built here")
