"""Async vs sync RL on the multi-turn calculator task (long-tailed turn counts): trained tokens per second
and trainer idle ratio, measured in one invocation with the same config except ``mode``.

    python benchmarks/rl_async_vs_sync.py [--steps 12] [--config configs/rl_multiturn.yaml] [--max-staleness TAU]

Targets (issue 7): async >= 1.5x sync trained tokens/s; async trainer idle ratio <= 15%.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

from _results import write_json

from glm5_core.rl.config import load_config
from glm5_core.rl.driver import RLRun

KEEP = ("steps", "elapsed_s", "trained_tokens", "trained_tokens_per_s", "context_tokens_per_s",
        "trainer_idle_ratio", "rollout_idle_ratio", "staleness_histogram", "dropped_stale", "prefill_tokens",
        "prefill_tokens_saved", "engine_busy_s", "engine_prefill_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/rl_multiturn.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="alternate sync/async this many times; medians")
    parser.add_argument("--max-staleness", type=int, default=None, help="override the config's train.max_staleness")
    parser.add_argument("--out", default="benchmarks/results/rl_async_vs_sync.json")
    args = parser.parse_args()
    overrides = {"max_steps": args.steps}
    if args.max_staleness is not None:
        import yaml

        with open(args.config, "r", encoding="utf-8") as f:
            train = dict((yaml.safe_load(f) or {}).get("train", {}))
        overrides["train"] = dict(train, max_staleness=args.max_staleness)
    runs = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode in ("sync", "async"):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = load_config(args.config, dict(overrides, mode=mode, output_dir=tmp))
                summary = RLRun(cfg, log=lambda m: None).run()
            runs[mode].append({k: summary[k] for k in KEEP})
            print(mode, json.dumps(runs[mode][-1]), flush=True)

    def median(mode, key):
        values = sorted(r[key] for r in runs[mode])
        return values[len(values) // 2]

    speedup = median("async", "trained_tokens_per_s") / median("sync", "trained_tokens_per_s")
    idle = median("async", "trainer_idle_ratio")
    result = {"command": "python " + " ".join(sys.argv), "config": args.config, "runs": runs,
              "async_over_sync_trained_tokens_per_s": speedup, "async_trainer_idle_ratio": idle,
              "sync_trainer_idle_ratio": median("sync", "trainer_idle_ratio"),
              "targets": {"speedup": ">= 1.5", "async_trainer_idle_ratio": "<= 0.15"},
              "passed": speedup >= 1.5 and idle <= 0.15}
    write_json(args.out, result, shown={k: v for k, v in result.items() if k != "runs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
