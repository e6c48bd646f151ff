"""benchmarks/bench_selected_index_scores.py: bad flags exit 2 naming the flag; it refuses to time the reference
against itself when the cpu kernel is not there; a tiny run writes both implementations' medians."""
import json

import pytest

from tests.benchmarks.bench_scripts import (
    exits_1_without_the_kernel,
    exits_2_naming,
    load_benchmark,
    prepare_a_tiny_run,
)

OP = "dsa_selected_index_scores"


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "bench_selected_index_scores")


@pytest.mark.parametrize("flags, named", [(["--rounds", "0"], "--rounds"),
                                          (["--topk", "9", "--tokens", "8"], "--topk")])
def test_a_bad_flag_exits_2_naming_it(bench, capsys, flags, named):
    exits_2_naming(bench, capsys, flags, named)


def test_without_the_kernel_it_exits_1(bench, monkeypatch, capsys, tmp_path):
    exits_1_without_the_kernel(bench, monkeypatch, capsys, tmp_path, OP)


def test_a_tiny_run_writes_both_medians(bench, tmp_path, monkeypatch):
    prepare_a_tiny_run(monkeypatch, OP)
    out = tmp_path / "r.json"
    assert bench.main(["--tokens", "16", "--topk", "4", "--rounds", "2", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["median_s"]) == {"reference", "cpu"} and all(v > 0 for v in result["speedup"].values())
