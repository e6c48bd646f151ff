"""benchmarks/bench_selected_attention_target.py: bad flags exit 2 naming the flag; it refuses to time the
reference against itself when the cpu kernel is not there; a tiny run writes both implementations' medians."""
import json

import pytest

from tests.benchmarks.bench_scripts import (
    exits_2_naming,
    prepare_a_tiny_run,
    test_without_the_kernel_it_exits_1,  # noqa: F401 (collected here)
)

SCRIPT = "bench_selected_attention_target"  # what the bench fixture loads
OP = "dsa_selected_attention_target"  # the op it times


@pytest.mark.parametrize("flags, named", [(["--rounds", "0"], "--rounds"),
                                          (["--cases", "1x8", "--topk", "9"], "--topk"),
                                          (["--cases", "1x8", "--topk", "2", "3"], "--topk"),
                                          (["--cases", "8"], "--cases")])
def test_a_bad_flag_exits_2_naming_it(bench, capsys, flags, named):
    exits_2_naming(bench, capsys, flags, named)


def test_a_tiny_run_writes_both_medians(bench, tmp_path, monkeypatch):
    prepare_a_tiny_run(monkeypatch, OP)
    out = tmp_path / "r.json"
    assert bench.main(["--cases", "1x16", "2x9", "--topk", "4", "1", "--rounds", "2", "--threads", "1",
                       "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"1x16-K4", "2x9-K1"}
    for case in cases.values():
        assert {"reference", "cpu", "reference_selected", "cpu_selected"} <= set(case["median_s"])
        assert case["speedup"] > 0 and case["selected_speedup"] > 0
        assert case["max_abs_diff_vs_reference"] < 1e-5 and case["max_abs_diff_vs_reference_selected"] < 1e-5
