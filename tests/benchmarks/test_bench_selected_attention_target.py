"""benchmarks/bench_selected_attention_target.py: bad flags exit 2 naming the flag; it refuses to time the
reference against itself when the cpu kernel is not there; a tiny run writes both implementations' medians."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from glm5_core import registry

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its folder's _results
    spec = importlib.util.spec_from_file_location("bench_selected_attention_target_under_test",
                                                  BENCHMARKS / "bench_selected_attention_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags, named", [(["--rounds", "0"], "--rounds"),
                                          (["--cases", "1x8", "--topk", "9"], "--topk"),
                                          (["--cases", "1x8", "--topk", "2", "3"], "--topk"),
                                          (["--cases", "8"], "--cases")])
def test_a_bad_flag_exits_2_naming_it(bench, capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(flags)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_without_the_kernel_it_exits_1(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(registry, "runs_reference", lambda op, backend: True)
    assert bench.main(["--out", str(tmp_path / "r.json")]) == 1
    assert "runs the reference for dsa_selected_attention_target" in capsys.readouterr().err


def test_a_tiny_run_writes_both_medians(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave this process's thread count alone
    if registry.runs_reference("dsa_selected_attention_target", "cpu"):
        pytest.skip("the cpu extension is not built here")
    out = tmp_path / "r.json"
    assert bench.main(["--cases", "1x16", "2x9", "--topk", "4", "1", "--rounds", "2", "--threads", "1",
                       "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"1x16-K4", "2x9-K1"}
    for case in cases.values():
        assert {"reference", "cpu", "reference_selected", "cpu_selected"} <= set(case["median_s"])
        assert case["speedup"] > 0 and case["selected_speedup"] > 0
        assert case["max_abs_diff_vs_reference"] < 1e-5 and case["max_abs_diff_vs_reference_selected"] < 1e-5
