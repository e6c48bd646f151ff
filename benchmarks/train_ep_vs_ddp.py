"""Expert parallelism (EP=2) vs DDP on 2 processes: median tokens/s and memory per rank, tiny and small models.

Runs ``glm5 pretrain`` under ``torchrun --nproc_per_node 2`` once per setting (same config, same steps) through a
worker shim (this file with ``--worker``) that also records each rank's peak resident memory
(``getrusage`` ``ru_maxrss``); the summary gives the parameter and optimizer-state bytes each rank holds. The
settings, run in one invocation so the ratios are measured under the same load:
  ddp     every rank holds the whole model (``--parallel ddp``)
  ep2     ``--parallel ep=2``: each rank holds half the experts, FSDP2 shards the rest over both ranks
Models: ``tiny`` (configs/tiny.yaml as it is: hidden 128, 8 experts of FFN 96), ``small`` (the same file with
the ``SMALL`` overrides: hidden 256, 16 experts of FFN 256, dense FFN 768, larger MLA ranks) and ``small_short``
(small on 2 sequences of 32 tokens a step, where the model state rather than the activations sets the peak).
Peak memory is reported three ways per rank: the process's peak RSS; that above the RSS at the worker's start
(torch and glm5_core imported, the same in every setting); and the peak RSS of the training steps alone (reset
when the step loop starts, read when it ends: model build and sharding before, and the end-of-run digest and HF
export, which gather the whole model, after, are left out). The last is the one EP is meant to lower.

    python benchmarks/train_ep_vs_ddp.py [--steps 20] [--models tiny small] [--out PATH.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

KEEP = ("median_tokens_per_s", "wall_s", "parameter_bytes_per_rank", "optimizer_state_bytes_per_rank",
        "first_lm_loss", "last_lm_loss")
SMALL = ["model.hidden_size=256", "model.n_routed_experts=16", "model.moe_intermediate_size=256",
         "model.intermediate_size=768", "model.q_lora_rank=128", "model.kv_lora_rank=64"]
# the small model on a short batch (2 sequences of 32 tokens): the model state, not the activations, dominates
SMALL_SHORT = SMALL + ["data.batch_size=2", "data.seq_len=32"]
MODELS = {"tiny": [], "small": SMALL, "small_short": SMALL_SHORT}
SETTINGS = {"ddp": "ddp", "ep2": "ep=2"}


def _current_rss() -> int:
    """This process's resident bytes now (Linux /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_kib() -> int:
    """VmHWM (the peak resident size, KiB) of this process (Linux)."""
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def worker(argv: list[str]) -> int:
    """torchrun worker: ``glm5 pretrain`` with the given arguments, then this rank's peak RSS into
    ``<output dir>/peak_rss_rank<r>.json``: over the whole process, and over the training steps alone (the
    peak is reset when the step loop starts, ``/proc/self/clear_refs``, and read when it ends, before the
    end-of-run digest and HF export, which gather the whole model)."""
    from glm5_core.cli import main as cli_main
    from glm5_core.train import trainer

    start = _current_rss()  # torch and glm5_core imported: what every setting holds before training
    steps: dict[str, int] = {}
    run, finish = trainer.PretrainTrainer.run, trainer.PretrainTrainer._finish

    def run_with_reset(self):
        steps["start"] = _current_rss()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
        return run(self)

    def finish_after_reading(self, *args, **kwargs):
        steps["peak"] = _peak_rss_kib() * 1024
        return finish(self, *args, **kwargs)

    trainer.PretrainTrainer.run, trainer.PretrainTrainer._finish = run_with_reset, finish_after_reading
    code = cli_main(["pretrain", *argv])
    out = Path(argv[argv.index("--output-dir") + 1])
    rank = int(os.environ.get("RANK", "0"))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    (out / f"peak_rss_rank{rank}.json").write_text(json.dumps({
        "peak_rss_bytes": peak_kib * 1024, "peak_rss_above_start_bytes": peak_kib * 1024 - start,
        "steps_peak_rss_bytes": steps["peak"], "steps_start_rss_bytes": steps["start"]}))
    return code or 0


def run(model: str, setting: str, args, out: Path) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone", "--nproc_per_node=2",
           __file__, "--worker", "--config", args.config, "--backend", args.backend,
           "--max-steps", str(args.steps), "--parallel", SETTINGS[setting], "--output-dir", str(out),
           "--set", "logging.progress_bar=false", "--set", "logging.plot=false", "--set", "logging.tensorboard=false",
           "--set", "checkpoint.every_steps=0"]
    for item in MODELS[model]:
        cmd += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{model} {setting} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    row = {k: summary.get(k) for k in KEEP}
    peaks = [json.loads((out / f"peak_rss_rank{r}.json").read_text()) for r in range(2)]
    row["peak_rss_bytes_per_rank"] = [p["peak_rss_bytes"] for p in peaks]
    row["peak_rss_above_start_bytes_per_rank"] = [p["peak_rss_above_start_bytes"] for p in peaks]
    row["steps_peak_rss_bytes_per_rank"] = [p["steps_peak_rss_bytes"] for p in peaks]
    row["steps_start_rss_bytes_per_rank"] = [p["steps_start_rss_bytes"] for p in peaks]
    row["model_state_bytes_per_rank"] = row["parameter_bytes_per_rank"] + row["optimizer_state_bytes_per_rank"]
    return row


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/train_ep_vs_ddp.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps: expected >= 2, got {args.steps}")
    work = Path(tempfile.mkdtemp(prefix="ep_vs_ddp_"))
    result = {"command": "python " + " ".join(sys.argv), "processes": 2, "steps": args.steps,
              "small_overrides": SMALL, "models": {}}
    try:
        for model in args.models:
            rows = {s: run(model, s, args, work / f"{model}_{s}") for s in SETTINGS}
            ddp, ep2 = rows["ddp"], rows["ep2"]
            result["models"][model] = {
                "rows": rows,
                "ep2_over_ddp_tokens_per_s": ep2["median_tokens_per_s"] / ddp["median_tokens_per_s"],
                "ep2_over_ddp_model_state_bytes": ep2["model_state_bytes_per_rank"] / ddp["model_state_bytes_per_rank"],
                "ep2_over_ddp_peak_rss": max(ep2["peak_rss_bytes_per_rank"]) / max(ddp["peak_rss_bytes_per_rank"]),
                "ep2_over_ddp_peak_rss_above_start": max(ep2["peak_rss_above_start_bytes_per_rank"]) /
                    max(ddp["peak_rss_above_start_bytes_per_rank"]),
                "ep2_over_ddp_steps_peak_rss": max(ep2["steps_peak_rss_bytes_per_rank"]) /
                    max(ddp["steps_peak_rss_bytes_per_rank"]),
            }
            print(json.dumps({model: {k: v for k, v in result["models"][model].items() if k != "rows"}}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
