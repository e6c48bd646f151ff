"""FSDP2 vs DDP pretraining on 2 processes: median tokens/s and per-rank parameter / optimizer-state bytes.

Runs ``glm5 pretrain`` under ``torchrun --nproc_per_node 2`` once per strategy (same config, same steps) and
reads each run's summary. Both runs go through one invocation, so the ratio is measured under the same load.

    python benchmarks/train_fsdp2_vs_ddp.py [--config configs/tiny.yaml] [--steps 30] [--backend cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import write_json

KEEP = ("median_tokens_per_s", "wall_s", "parameter_bytes_per_rank", "optimizer_state_bytes_per_rank",
        "first_lm_loss", "last_lm_loss")


def run(strategy: str, args, out: Path) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone", "--nproc_per_node=2",
           "-m", "glm5_core.cli", "pretrain", "--config", args.config, "--backend", args.backend,
           "--max-steps", str(args.steps), "--parallel", strategy, "--output-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{strategy} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {k: summary.get(k) for k in KEEP}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/train_fsdp2_vs_ddp.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps: expected >= 2, got {args.steps}")
    work = Path(tempfile.mkdtemp(prefix="fsdp2_vs_ddp_"))
    try:
        rows = {s: run(s, args, work / s) for s in ("ddp", "fsdp2")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ddp, fsdp2 = rows["ddp"], rows["fsdp2"]
    result = {"command": "python " + " ".join(sys.argv), "processes": 2, "steps": args.steps, "rows": rows,
              "fsdp2_over_ddp_tokens_per_s": fsdp2["median_tokens_per_s"] / ddp["median_tokens_per_s"],
              "fsdp2_over_ddp_parameter_bytes": fsdp2["parameter_bytes_per_rank"] / ddp["parameter_bytes_per_rank"],
              "fsdp2_over_ddp_optimizer_bytes":
                  fsdp2["optimizer_state_bytes_per_rank"] / ddp["optimizer_state_bytes_per_rank"]}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
