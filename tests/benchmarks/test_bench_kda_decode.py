"""benchmarks/bench_kda_decode.py: a tiny run writes the native and torch decode-step times with their ratios and
agreement, it refuses to time the reference against itself, and bad sizes exit 2."""
import json

import pytest

from tests.benchmarks.bench_scripts import (  # noqa: F401
    exits_2_naming,
    load_benchmark,
    prepare_a_tiny_run,
    test_without_the_kernel_it_exits_1,
)

OP = "kda_recurrent"


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "bench_kda_decode")


def test_a_tiny_run_writes_ratios_and_agreement(bench, tmp_path, monkeypatch):
    prepare_a_tiny_run(monkeypatch, OP)
    out = tmp_path / "decode.json"
    assert bench.main(["--cases", "tiny-b1", "--rounds", "1", "--calls", "1", "--out", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["case"] == "tiny_glm53 B=1" and case["speedup_cpu_time"]["recurrent"] > 0
    assert case["max_abs_diff"]["recurrent"] < 1e-5 and case["max_abs_diff"]["conv_update"] < 1e-5


def test_bad_sizes_exit_2(bench, capsys):
    exits_2_naming(bench, capsys, ["--rounds", "0"], "--rounds")
    exits_2_naming(bench, capsys, ["--cases", "huge"], "--cases")
