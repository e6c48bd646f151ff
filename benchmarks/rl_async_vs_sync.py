"""Async vs sync RL on the multi-turn calculator task (long-tailed turn counts): trained tokens per second
and trainer idle ratio, measured in one invocation with the same config except ``mode``.

    python benchmarks/rl_async_vs_sync.py [--steps 12] [--repeats 3] [--config configs/rl_multiturn.yaml]
                                          [--batch-size B] [--max-staleness TAU] [--warmup-steps 2]

Fairness:
* Equal in-flight counts. sync plays one batch at a time, so it has ``train.batch_size`` trajectories in
  flight; async gets the same number (``rollout.max_inflight_groups = batch_size / group_size``), whatever the
  config says. ``--batch-size`` changes both (e.g. 32 fills a 32-slot engine in both modes).
* Alternating order: repeat 0 runs sync then async, repeat 1 async then sync, and so on; medians over repeats
  (and the median of the per-repeat async/sync ratios). A short discarded warm-up run of each mode first
  absorbs one-time costs (native extension load, page cache) that would otherwise land on the first run.

Trainer time, measured here by timing the trainer's calls inside each run (the driver is not changed), over
the driver's step loop (``elapsed_s``):
* ``take_wait_s``: waiting for a batch (the driver's ``trainer_idle_ratio`` = take_wait_s / elapsed_s; in
  sync mode that wait is the whole rollout);
* ``compute_s``: ``PolicyTrainer.train_step`` (loss, backward, optimizer step);
* ``push_s``: weight pushes (write the safetensors file, tell every engine);
* ``eval_s``: evaluations inside the loop (none with the default ``eval.every: 0``);
* ``other_s``: the rest (metrics logging, bookkeeping).
``trainer_idle_ratio_corrected`` = 1 - compute_s / elapsed_s: everything but optimizer / loss compute is idle.

Targets (issue 7): async >= 1.5x sync trained tokens/s; async trainer idle ratio <= 15%.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from typing import Callable

KEEP = ("steps", "elapsed_s", "trained_tokens", "trained_tokens_per_s", "context_tokens_per_s",
        "trainer_idle_ratio", "rollout_idle_ratio", "staleness_histogram", "dropped_stale", "prefill_tokens",
        "prefill_tokens_saved", "engine_busy_s", "engine_prefill_s")
MODES = ("sync", "async")


class TrainerClock:
    """Seconds the trainer thread of one :class:`RLRun` spends in compute, weight pushes and in-loop evaluation.

    Wraps ``run.trainer.train_step``, ``run._push_weights`` and ``run.evaluate`` on the instance. Evaluations
    before the first training step (the driver's step-0 eval) and after the loop ends (the first
    ``run.runner.stop()`` call, right after the driver reads ``elapsed_s``) are outside the loop and not counted.
    """

    def __init__(self, run):
        self.seconds = {"compute": 0.0, "push": 0.0, "eval": 0.0}
        self._loop_started = self._loop_ended = False
        self._wrap(run.trainer, "train_step", "compute", starts_loop=True)
        self._wrap(run, "_push_weights", "push")
        self._wrap(run, "evaluate", "eval")
        stop = run.runner.stop

        def stop_and_mark():
            self._loop_ended = True
            return stop()

        run.runner.stop = stop_and_mark

    def _wrap(self, owner, name: str, bucket: str, starts_loop: bool = False) -> None:
        inner: Callable = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            if starts_loop:
                self._loop_started = True
            counted = self._loop_started and not self._loop_ended
            t0 = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                if counted:
                    self.seconds[bucket] += time.monotonic() - t0

        setattr(owner, name, timed)

    def breakdown(self, summary: dict) -> dict[str, float]:
        """The trainer's loop time split into take-wait / compute / push / eval / other, and both idle ratios."""
        elapsed = max(summary["elapsed_s"], 1e-9)
        take_wait = summary["trainer_idle_ratio"] * elapsed  # the driver's own measure: time in take() / rollout
        parts = {"take_wait_s": take_wait, "compute_s": self.seconds["compute"], "push_s": self.seconds["push"],
                 "eval_s": self.seconds["eval"]}
        parts["other_s"] = max(0.0, elapsed - sum(parts.values()))
        parts["trainer_idle_ratio_take_wait"] = summary["trainer_idle_ratio"]
        parts["trainer_idle_ratio_corrected"] = 1.0 - self.seconds["compute"] / elapsed
        return parts


def load_sections(path: str) -> dict:
    import yaml

    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"--config: {path!r} is not valid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: expected a YAML mapping in {path!r}, got {type(data).__name__}")
    return data


def run_config(base: dict, args, mode: str, steps: int, output_dir: str):
    """The benchmark's config for ``mode``: equal in-flight count, the batch size and staleness flags applied."""
    from glm5_core.rl.config_loader import config_from_dict

    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    train, rollout = data.setdefault("train", {}), data.setdefault("rollout", {})
    if args.batch_size is not None:
        train["batch_size"] = args.batch_size
    if args.max_staleness is not None:
        train["max_staleness"] = args.max_staleness
    cfg = config_from_dict(dict(data, mode=mode, max_steps=steps, output_dir=output_dir))
    # sync has one batch in flight: give async the same number of trajectories (whole groups)
    rollout["max_inflight_groups"] = cfg.train.batch_size // cfg.rollout.group_size
    return config_from_dict(dict(data, mode=mode, max_steps=steps, output_dir=output_dir))


def measure(base: dict, args, mode: str, steps: int) -> dict:
    from glm5_core.rl.driver import RLRun

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_config(base, args, mode, steps, tmp)
        run = RLRun(cfg, log=lambda m: None)
        clock = TrainerClock(run)
        summary = run.run()
    row = {k: summary[k] for k in KEEP}
    row.update(clock.breakdown(summary))
    row.update(inflight_trajectories=cfg.train.batch_size, batch_size=cfg.train.batch_size,
               max_inflight_groups=cfg.rollout.max_inflight_groups if mode == "async" else None,
               engine_slots=cfg.rollout.max_batch, loadavg_1min_before=load_before,
               loadavg_1min_after=os.getloadavg()[0])
    return row


def round_orders(repeats: int) -> list[tuple[str, ...]]:
    """Mode order of each repeat: sync first, then async first, alternating."""
    return [MODES if repeat % 2 == 0 else MODES[::-1] for repeat in range(repeats)]


def median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/rl_multiturn.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of both modes, order alternating; medians")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="override train.batch_size (= trajectories in flight in both modes)")
    parser.add_argument("--max-staleness", type=int, default=None, help="override the config's train.max_staleness")
    parser.add_argument("--warmup-steps", type=int, default=2, help="discarded warm-up run of each mode (0: none)")
    parser.add_argument("--out", default="benchmarks/results/rl_async_vs_sync.json")
    args = parser.parse_args()
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            parser.exit(2, f"--{name}: expected >= 1, got {getattr(args, name)}\n")
    if args.warmup_steps < 0:
        parser.exit(2, f"--warmup-steps: expected >= 0, got {args.warmup_steps}\n")
    try:
        base = load_sections(args.config)
        run_config(base, args, "async", args.steps, tempfile.gettempdir())  # bad config / flags: one line, exit 2
    except OSError as exc:
        parser.exit(2, f"--config: {exc}\n")
    except (ValueError, TypeError) as exc:
        parser.exit(2, f"{exc}\n")
    from _results import write_json  # benchmarks/ (the script's folder) is on sys.path when run as a script

    if args.warmup_steps:
        for mode in MODES:
            measure(base, args, mode, args.warmup_steps)
            print(f"warm-up {mode} done", flush=True)
    runs = {mode: [] for mode in MODES}
    orders = []
    for repeat, order in enumerate(round_orders(args.repeats)):
        orders.append(list(order))
        for mode in order:
            row = measure(base, args, mode, args.steps)
            row["repeat"], row["position_in_repeat"] = repeat, order.index(mode)
            runs[mode].append(row)
            print(mode, json.dumps(row), flush=True)

    def med(mode: str, key: str) -> float:
        return median([r[key] for r in runs[mode]])

    per_repeat = [a["trained_tokens_per_s"] / s["trained_tokens_per_s"] for s, a in zip(runs["sync"], runs["async"])]
    speedup = med("async", "trained_tokens_per_s") / med("sync", "trained_tokens_per_s")
    idle = med("async", "trainer_idle_ratio_corrected")
    result = {
        "command": "python " + " ".join(sys.argv), "config": args.config, "orders": orders,
        "inflight_trajectories": runs["sync"][0]["inflight_trajectories"], "runs": runs,
        "async_over_sync_trained_tokens_per_s": speedup,
        "async_over_sync_per_repeat": per_repeat, "async_over_sync_median_of_repeats": median(per_repeat),
        "trained_tokens_per_s_median": {m: med(m, "trained_tokens_per_s") for m in MODES},
        "trainer_idle_ratio_corrected_median": {m: med(m, "trainer_idle_ratio_corrected") for m in MODES},
        "trainer_idle_ratio_take_wait_median": {m: med(m, "trainer_idle_ratio_take_wait") for m in MODES},
        "targets": {"speedup": ">= 1.5", "async_trainer_idle_ratio_corrected": "<= 0.15"},
        "passed": speedup >= 1.5 and idle <= 0.15,
    }
    write_json(args.out, result, shown={k: v for k, v in result.items() if k != "runs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
