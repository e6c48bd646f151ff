"""Two processes under torchrun on CPU (gloo): the run completes and the ranks end bitwise in sync."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml


@pytest.mark.skipif(shutil.which("torchrun") is None
                    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun is not installed")
def test_two_process_ddp_run_stays_in_sync(small_raw, tmp_path):
    small_raw["data"]["batch_size"] = 4  # 2 rows per rank
    small_raw["stages"] = [dict(kind="dense", steps=2),
                           dict(kind="indexer_warmup", steps=1, indexer_lr=5e-3, indexer_final_lr=2e-4),
                           dict(kind="sparse", steps=1)]
    config = tmp_path / "ddp.yaml"
    config.write_text(yaml.safe_dump(small_raw))
    out = tmp_path / "ddp"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", "--nproc_per_node=2",
           "-m", "glm5_core.cli", "pretrain", "--config", str(config), "--backend", "cpu", "--output-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # DDP's find_unused_parameters warning (once per rank, every run) is gone: every trainable parameter is used
    assert "find_unused_parameters" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == [0, 4]
    digests = summary["parameter_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks diverged"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in records] == ["dense", "dense", "indexer_warmup", "sparse"]
