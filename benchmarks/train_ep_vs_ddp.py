"""Expert parallelism (EP=N) vs DDP on N processes: median tokens/s and memory per rank, tiny and small models.

Runs ``glm5 pretrain`` under ``torchrun --nproc_per_node N`` once per setting (same config, same steps) through a
worker shim (this file with ``--worker``) that also records each rank's memory; the summary gives the parameter
and optimizer-state bytes each rank holds. The settings, run in one invocation so the ratios are measured under
the same load (``--repeats R``: R rounds, the two settings' order alternating round to round, medians reported):
  ddp     every rank holds the whole model (``--parallel ddp``)
  ep      ``--parallel ep=N``: each rank holds 1/N of the experts, FSDP2 shards the rest over the N ranks
Models: ``tiny`` (configs/tiny.yaml as it is: hidden 128, 8 experts of FFN 96), ``small`` (the same file with
the ``SMALL`` overrides: hidden 256, 16 experts of FFN 256, dense FFN 768, larger MLA ranks), ``small_short``
(small on 2 sequences of 32 tokens a step) and ``experts`` (a benchmark model whose routed experts are ~95% of
its parameters: tiny with 32 experts of FFN 256, 4 sequences of 32 tokens a step; ``EXPERTS``).
Memory per rank, from ``/proc/self/status`` (``VmHWM``, the peak resident size, reset through
``/proc/self/clear_refs`` at each point) and ``getrusage``:
  peak_rss        the process's peak RSS (the largest of the three phases' below);
  start_rss       the RSS at the worker's start (torch and glm5_core imported): the runtime baseline, the same in
                  every setting; ``*_above_start`` subtract it;
  build_peak      the peak from the start to the first step (model build, sharding, optimizer, data pipeline);
  steps_peak      the peak over the training steps alone (reset when the step loop starts, read when it ends);
  finish_peak     the peak of the end of the run (the digest and the HF export, which stream the whole model).
``--malloc-mmap-threshold BYTES`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` in the workers, so every allocation of
that size or more is returned to the system when freed: RSS then follows the live tensors (an allocator-level
peak), where by default freed blocks stay resident and an earlier phase's peak hides a later one's.

    python benchmarks/train_ep_vs_ddp.py [--steps 20] [--models tiny small] [--processes 2 4] [--repeats 3]
        [--malloc-mmap-threshold 65536] [--out PATH.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
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
# a benchmark model whose routed experts dominate its memory (~95% of the parameters), on a short batch
EXPERTS = ["model.n_routed_experts=32", "model.moe_intermediate_size=256", "data.batch_size=4", "data.seq_len=32"]
MODELS = {"tiny": [], "small": SMALL, "small_short": SMALL_SHORT, "experts": EXPERTS}
SETTINGS = ("ddp", "ep")
POINTS = ("build", "steps", "finish")


def _current_rss() -> int:
    """This process's resident bytes now (Linux /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_kib() -> int:
    """VmHWM (the peak resident size, KiB) of this process (Linux)."""
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS


def worker(argv: list[str]) -> int:
    """torchrun worker: ``glm5 pretrain`` with the given arguments, then this rank's memory into
    ``<output dir>/peak_rss_rank<r>.json``: the whole process's peak RSS, the RSS at the start, and the peak of
    each phase (build, steps, finish; see the module docstring)."""
    from glm5_core.cli import main as cli_main
    from glm5_core.train import trainer

    start = _current_rss()  # torch and glm5_core imported: what every setting holds before training
    _reset_peak()
    points: dict[str, int] = {}
    run, finish = trainer.PretrainTrainer.run, trainer.PretrainTrainer._finish

    def run_with_reset(self):
        points["build_peak"] = _peak_rss_kib() * 1024
        points["steps_start"] = _current_rss()
        _reset_peak()
        return run(self)

    def finish_after_reading(self, *args, **kwargs):
        points["steps_peak"] = _peak_rss_kib() * 1024
        points["finish_start"] = _current_rss()
        _reset_peak()
        out = finish(self, *args, **kwargs)
        points["finish_peak"] = _peak_rss_kib() * 1024
        return out

    trainer.PretrainTrainer.run, trainer.PretrainTrainer._finish = run_with_reset, finish_after_reading
    code = cli_main(["pretrain", *argv])
    out = Path(argv[argv.index("--output-dir") + 1])
    rank = int(os.environ.get("RANK", "0"))
    # each reset lowers getrusage's ru_maxrss too: the process's peak is the largest of the phases'
    peak = max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024] +
               [v for k, v in points.items() if k.endswith("_peak")])
    (out / f"peak_rss_rank{rank}.json").write_text(json.dumps({
        "peak_rss_bytes": peak, "start_rss_bytes": start,
        **{f"{k}_bytes": v for k, v in points.items()}}))
    return code or 0


def run(model: str, setting: str, processes: int, args, out: Path) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    parallel = "ddp" if setting == "ddp" else f"ep={processes}"
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone", f"--nproc_per_node={processes}",
           __file__, "--worker", "--config", args.config, "--backend", args.backend,
           "--max-steps", str(args.steps), "--parallel", parallel, "--output-dir", str(out),
           "--set", "logging.progress_bar=false", "--set", "logging.plot=false", "--set", "logging.tensorboard=false",
           "--set", "checkpoint.every_steps=0"]
    for item in MODELS[model]:
        cmd += ["--set", item]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{model} {setting} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    row = {k: summary.get(k) for k in KEEP}
    peaks = [json.loads((out / f"peak_rss_rank{r}.json").read_text()) for r in range(processes)]
    for key in ("peak_rss", "start_rss", "build_peak", "steps_start", "steps_peak", "finish_start", "finish_peak"):
        row[f"{key}_bytes_per_rank"] = [p[f"{key}_bytes"] for p in peaks]
    row["model_state_bytes_per_rank"] = row["parameter_bytes_per_rank"] + row["optimizer_state_bytes_per_rank"]
    return row


def _max_above_start(row: dict, key: str) -> int:
    """The largest rank's ``key`` peak above its own start RSS (the runtime baseline)."""
    return max(p - s for p, s in zip(row[f"{key}_bytes_per_rank"], row["start_rss_bytes_per_rank"]))


def _ratios(ddp: dict, ep: dict) -> dict:
    out = {"tokens_per_s": ep["median_tokens_per_s"] / ddp["median_tokens_per_s"],
           "model_state_bytes": ep["model_state_bytes_per_rank"] / ddp["model_state_bytes_per_rank"],
           "peak_rss": max(ep["peak_rss_bytes_per_rank"]) / max(ddp["peak_rss_bytes_per_rank"]),
           "peak_rss_above_start": _max_above_start(ep, "peak_rss") / _max_above_start(ddp, "peak_rss")}
    for point in POINTS:
        out[f"{point}_peak_above_start"] = _max_above_start(ep, f"{point}_peak") / \
            _max_above_start(ddp, f"{point}_peak")
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["tiny", "small", "small_short"])
    parser.add_argument("--processes", nargs="+", type=int, default=[2])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/train_ep_vs_ddp.json")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps: expected >= 2, got {args.steps}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected >= 1, got {args.repeats}")
    if any(n < 2 for n in args.processes):
        parser.error(f"--processes: expected counts >= 2, got {args.processes}")
    work = Path(tempfile.mkdtemp(prefix="ep_vs_ddp_"))
    result = {"command": "python " + " ".join(sys.argv), "steps": args.steps, "repeats": args.repeats,
              "malloc_mmap_threshold": args.malloc_mmap_threshold, "overrides": {m: MODELS[m] for m in args.models},
              "runs": {}}
    try:
        for repeat in range(args.repeats):
            for model in args.models:
                for n in args.processes:
                    order = SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]
                    rows = {s: run(model, s, n, args, work / f"{model}_{n}_{s}_{repeat}") for s in order}
                    key = f"{model}/{n}"
                    result["runs"].setdefault(key, []).append({"rows": rows, "ep_over_ddp": _ratios(rows["ddp"],
                                                                                                   rows["ep"])})
                    print(json.dumps({key: result["runs"][key][-1]["ep_over_ddp"]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["median_ep_over_ddp"] = {
        key: {k: statistics.median(r["ep_over_ddp"][k] for r in runs) for k in runs[0]["ep_over_ddp"]}
        for key, runs in result["runs"].items()}
    write_json(args.out, result, shown=result["median_ep_over_ddp"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
