"""benchmarks/bench_selected_index_scores.py: bad flags exit 2 naming the flag; it refuses to time the reference
against itself when the cpu kernel is not there; a tiny run writes both implementations' medians."""
import json

import pytest

from tests.benchmarks.bench_scripts import (
    exits_2_naming,
    prepare_a_tiny_run,
    test_without_the_kernel_it_exits_1,  # noqa: F401 (collected here)
)

SCRIPT = "bench_selected_index_scores"  # what the bench fixture loads
OP = "dsa_selected_index_scores"  # the op it times


@pytest.mark.parametrize("flags, named", [(["--rounds", "0"], "--rounds"),
                                          (["--topk", "9", "--tokens", "8"], "--topk")])
def test_a_bad_flag_exits_2_naming_it(bench, capsys, flags, named):
    exits_2_naming(bench, capsys, flags, named)


def test_a_tiny_run_writes_both_medians(bench, tmp_path, monkeypatch):
    prepare_a_tiny_run(monkeypatch, OP)
    out = tmp_path / "r.json"
    assert bench.main(["--tokens", "16", "--topk", "4", "--rounds", "2", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["median_s"]) == {"reference", "cpu"} and all(v > 0 for v in result["speedup"].values())
