"""The CPU-checkable parts of benchmarks/gpu/bench_ep.py (the multi-GPU DeepEP vs reference exchange benchmark):
its arguments (one line, exit 2), the refusal outside torchrun or without GPUs, the byte counts against hand
counts, and the whole code path under torchrun on 2 gloo processes (--dry-run) with DeepEP's stand-in
(tests/backends/cuda/deep_ep_standin.py) in place of deep_ep."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "gpu" / "bench_ep.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_ep_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,named", [
    (["--tokens", "0"], "argument --tokens: expected a positive integer, got 0"),
    (["--hidden", "x"], "argument --hidden: expected a positive integer, got 'x'"),
    (["--experts", "8", "--top-k", "9"], "--top-k: expected at most --experts (8), got 9"),
    (["--backend", "mpi"], "argument --backend: invalid choice"),
])
def test_bad_arguments_exit_2_in_one_line(bench, capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err and err.count("\n") == 1, err


def test_defaults_and_dry_run(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    args = bench.parse_args([])
    assert (args.backend, args.tokens, args.hidden, args.experts, args.top_k) == ("nccl", 4096, 7168, 256, 8)
    assert args.out == os.path.join(str(tmp_path), "ep_gpu.json")
    dry = bench.parse_args(["--dry-run", "--out", "x.json"])
    assert (dry.backend, dry.tokens, dry.experts, dry.rounds, dry.out) == ("gloo", 24, 8, 2, "x.json")


def test_outside_torchrun_or_without_gpus_it_refuses(bench, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert bench.main(["--dry-run"]) == 2
    assert "run it under torchrun" in capsys.readouterr().err
    if not torch.cuda.is_available():
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        assert bench.main([]) == 2
        assert "--backend nccl needs cuda GPUs" in capsys.readouterr().err


def test_bytes_follow_the_routing(bench):
    # 2 ranks, 4 experts (2 each), rank 0's 3 tokens: {0,1} stays home, {1,2} one slot out, {2,3} two slots out
    ids = torch.tensor([[0, 1], [1, 2], [2, 3]])
    D = 8
    assert bench._bytes_reference(ids, 4, 2, 0, D) == 2 * 3 * D * 2 + 2 * 2 * 2 * 8
    # DeepEP: tokens 1 and 2 each go once to rank 1 (x row + 2 int64 ids + 2 fp32 weights), 3 slot rows back
    assert bench._bytes_deep_ep(ids, 4, 2, 0, D) == 2 * (D * 2 + 2 * 8 + 2 * 4) + 3 * D * 2


def test_without_deep_ep_the_rows_say_why(bench):
    from glm5_core.backends.cuda import ep_layouts

    if ep_layouts.deep_ep_importable()[0]:
        pytest.skip("deep_ep is importable here")
    why: list = []
    args = argparse.Namespace(deep_ep_module="deep_ep", backend="gloo")
    assert bench._deep_ep_buffer(args, None, why) is None
    assert why == ["deep_ep is not importable: the reference (all_to_all_single over NCCL) runs"]


def test_dry_run_on_two_gloo_processes_runs_every_path(tmp_path):
    out = tmp_path / "ep.json"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           "--dry-run", "--deep-ep-module", "tests.backends.cuda.deep_ep_standin", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLM5_SKIP_EXT="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    results = record["results"]
    assert record["environment"]["world_size"] == 2 and record["sizes"]["tokens_per_rank"] == 24
    for name in ("reference", "deep_ep_dispatch+reference_combine", "deep_ep"):
        row = results[name]
        assert row["dispatch_ms_median"] > 0 and row["combine_ms_median"] > 0, (name, row)
        assert row["bytes_sent_per_token_per_layer"] > 0
    assert results["contract"]["rows_bitwise_equal"] and results["contract"]["training_combine_bitwise_equal"]
    assert 0 <= results["contract"]["rollout_combine_max_abs_diff"] < 0.1
    assert set(results["ratios"]) == {"deep_ep_dispatch+reference_combine", "deep_ep"}
