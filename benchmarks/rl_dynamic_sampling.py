"""Dynamic sampling on and off: held-out greedy accuracy of ``glm5 rl`` on arithmetic from the Quickstart
checkpoint, and the trainer steps (and seconds) each setting takes to gain +0.2.

    python benchmarks/rl_dynamic_sampling.py --checkpoint runs/tiny/final [--config configs/rl_heldout.yaml]
        [--repeats 1] [--max-steps 150] [--max-minutes 6] [--target 0.2] [--set KEY=VALUE ...]
        [--out benchmarks/results/rl_dynamic_sampling]

Each run is one ``glm5 rl`` process (the CLI itself) with ``dynamic_sampling.enabled`` false or true and
nothing else changed; repeats alternate the order (off first, then on first, ...). From each run's
``summary.json`` (``eval_history``: an evaluation at start, every ``eval.every`` steps and at the end) and
``metrics.jsonl`` (elapsed seconds per step): greedy accuracy and pass@k before and after, and the first
evaluated step whose greedy accuracy (and pass@1) is >= the start's + target (null: not reached).
``--config configs/rl_heldout_digits.yaml`` is the held-out task on which +0.2 is reached (see
benchmarks/results/rl_dynamic_sampling.md); the default, configs/rl_heldout.yaml, is the one on which it is not.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def first_step_reaching(history: list[dict], key: str, target: float) -> Optional[int]:
    """The first evaluated step whose ``key`` is >= the first evaluation's + ``target``."""
    rows = [r for r in history if key in r]
    if not rows:
        return None
    goal = rows[0][key] + target - 1e-9
    return next((r["step"] for r in rows[1:] if r[key] >= goal), None)


def _elapsed_at(metrics_path: str) -> dict[int, float]:
    out: dict[int, float] = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if "elapsed_s" in row:
                out[row["step"]] = row["elapsed_s"]
    return out


def run_once(args, dynamic: bool, out_dir: str) -> dict:
    command = [sys.executable, "-m", "glm5_core.cli", "rl", "--config", args.config, "--checkpoint", args.checkpoint,
               "--output-dir", out_dir, "--max-steps", str(args.max_steps), "--max-minutes", str(args.max_minutes),
               *[a for item in args.set for a in ("--set", item)],
               "--set", f"dynamic_sampling.enabled={'true' if dynamic else 'false'}"]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    history = summary["eval_history"]
    elapsed = _elapsed_at(os.path.join(out_dir, "metrics.jsonl"))
    result = {"dynamic_sampling": dynamic, "steps": summary["steps"], "elapsed_s": summary["elapsed_s"],
              "eval_start": summary["eval_start"], "eval_end": summary["eval_end"], "eval_history": history,
              "issued_trajectories": summary["issued_trajectories"],
              "dynamic_dropped_groups": summary.get("dynamic_dropped_groups"),
              "dynamic_filled_groups": summary.get("dynamic_filled_groups"), "command": " ".join(command[1:])}
    for key in ("eval_greedy", "eval_pass@1"):
        step = first_step_reaching(history, key, args.target)
        result[f"steps_to_target_{key}"] = step
        result[f"seconds_to_target_{key}"] = elapsed.get(step) if step is not None else None
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--config", default=os.path.join("configs", "rl_heldout.yaml"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--max-minutes", type=float, default=6.0)
    parser.add_argument("--target", type=float, default=0.2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every run (e.g. env.held_out=0)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "rl_dynamic_sampling"))
    parser.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "rl_dynamic_sampling"))
    args = parser.parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for dynamic in order:
            out_dir = os.path.join(args.runs_dir, f"r{repeat}_{'on' if dynamic else 'off'}")
            runs.append({"repeat": repeat, **run_once(args, dynamic, out_dir)})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "eval_history"}), flush=True)
    report = {"benchmark": "rl_dynamic_sampling", "target": args.target, "config": args.config, "sets": args.set,
              "checkpoint": args.checkpoint, "max_steps": args.max_steps, "max_minutes": args.max_minutes,
              "command": " ".join(["python", "benchmarks/rl_dynamic_sampling.py", *(argv or sys.argv[1:])]),
              "runs": runs}
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
