"""benchmarks/bench_kda.py: a tiny run writes its result with the ratio and the agreement, and it refuses to time
the reference against itself."""
import json

import pytest

from tests.benchmarks.bench_scripts import load_benchmark, test_without_the_kernel_it_exits_1  # noqa: F401

OP = "kda_chunked"

pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "bench_kda")


def test_a_tiny_run_writes_ratios_and_agreement(bench, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.set_num_threads", lambda n: None)
    out = tmp_path / "kda.json"
    assert bench.main(["--tokens", "70", "--heads", "1", "--head-dim", "8", "--rounds", "1", "--threads", "1",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["speedup_wall"] > 0 and result["speedup_cpu_time"] > 0
    assert result["max_abs_diff"]["output"] < 1e-5 and result["max_abs_diff"]["gradients"] < 1e-4


def test_bad_sizes_exit_2(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--tokens", "0"])
    assert exit_info.value.code == 2 and "--tokens" in capsys.readouterr().err
