"""Async vs sync RL on the multi-turn calculator task (long-tailed turn counts): trained tokens per second
and trainer idle ratio, measured in one invocation with the same config except ``mode``.

    python benchmarks/rl_async_vs_sync.py [--steps 12] [--repeats 3] [--config configs/rl_multiturn.yaml]
                                          [--batch-size B] [--max-staleness TAU] [--warmup-steps 2]
                                          [--trainer-device cpu:0 --engine-devices cpu:1]
                                          [--admission staleness|slots] [--plot PNG]

Equal resources (issue 33): ``--trainer-device`` / ``--engine-devices`` (CPU core sets, or accelerators) give
both modes the same placement: the trainer's process pinned to one core set, the engines to the others, so in
sync mode the trainer's cores idle while the engines generate and in async mode both work at once, and neither
mode borrows the other's cores. ``configs/rl_longtail.yaml`` is the long-tailed workload with that placement.
Also reported per mode: the engines' idle fraction, the dropped fraction (stale, failed, malformed over issued),
reward per wall-clock second (rewards of the trained trajectories / elapsed), and, where the target is missed,
``bubble``: the trainer-time component that keeps it from being met. ``--plot`` draws the cumulative reward over
wall-clock seconds of every run, both modes.

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

Targets (issue 33): async >= 2x sync trained tokens/s; async trainer idle ratio <= 20%; reward per second no
worse.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from typing import Callable, Optional

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
    if getattr(args, "trainer_device", None) is not None:
        train["device"] = args.trainer_device
    if getattr(args, "engine_devices", None) is not None:
        rollout["devices"] = args.engine_devices
    if getattr(args, "admission", None) is not None:
        rollout["admission"] = args.admission
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
        curve = reward_curve(os.path.join(tmp, "metrics.jsonl"), cfg.train.batch_size)
    row = {k: summary[k] for k in KEEP}
    row.update(clock.breakdown(summary))
    row.update(outcomes(summary, curve))
    row.update(inflight_trajectories=cfg.train.batch_size, batch_size=cfg.train.batch_size,
               max_inflight_groups=cfg.rollout.max_inflight_groups if mode == "async" else None,
               engine_slots=cfg.rollout.max_batch, loadavg_1min_before=load_before,
               trainer_device=cfg.train.device, engine_devices=cfg.rollout.devices,
               admission=cfg.rollout.admission if mode == "async" else None,
               loadavg_1min_after=os.getloadavg()[0])
    return row


def reward_curve(metrics_path: str, batch_size: int) -> list[tuple[float, float]]:
    """(elapsed seconds, cumulative reward of the trained trajectories) after each step of a run."""
    points, total = [], 0.0
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if "reward" in row and "elapsed_s" in row:
                total += row["reward"] * batch_size
                points.append((row["elapsed_s"], total))
    return points


def outcomes(summary: dict, curve: list[tuple[float, float]]) -> dict:
    """Engine idle and dropped fractions, reward per wall-clock second, the reward curve."""
    issued = max(1, summary["issued_trajectories"])
    dropped = summary["dropped_stale"] + summary["env_failures"] + summary["rollout_failures"] \
        + summary["dropped_malformed"]
    reward = curve[-1][1] if curve else 0.0
    return {"engine_idle_ratio": summary["rollout_idle_ratio"], "dropped_fraction": dropped / issued,
            "dropped_stale_fraction": summary["dropped_stale"] / issued, "reward_total": reward,
            "reward_per_s": reward / max(summary["elapsed_s"], 1e-9), "reward_curve": curve,
            "admission_refusals": summary.get("admission_refusals")}


BUBBLES = {
    "take_wait_s": "the trainer waits for batches: the engines produce trained tokens slower than the trainer "
                   "consumes them (rollout-bound; more engine cores or a faster engine, not more asynchrony)",
    "push_s": "weight pushes: the trainer writes and sends weights every push_every steps (raise push_every or "
              "use the distributed path)",
    "eval_s": "in-loop evaluations",
    "other_s": "trainer-side bookkeeping between steps (metrics, batch assembly)",
}


def bubble(async_row: dict, sync_row: dict, speedup: float, target_speedup: float,
           target_idle: float) -> Optional[str]:
    """What keeps the targets from being met (None: they are met): the largest idle component of the async
    trainer's time, or, with the trainer busy, the trainer's own compute (overlap can remove only the rollout
    wait sync had)."""
    idle = async_row["trainer_idle_ratio_corrected"]
    if speedup >= target_speedup and idle <= target_idle:
        return None
    engines_idle = async_row["engine_idle_ratio"] if async_row["engine_idle_ratio"] is not None else float("nan")
    if idle <= target_idle:
        busy = async_row["compute_s"] + async_row["push_s"]
        ceiling = sync_row["elapsed_s"] / max(busy, 1e-9) * (async_row["steps"] / max(sync_row["steps"], 1))
        wait = sync_row["take_wait_s"] / max(sync_row["elapsed_s"], 1e-9)
        return (f"trainer compute-bound: the async trainer computes {1 - idle:.0%} of its time, so async can be at "
                f"most ~{ceiling:.2f}x sync here (sync waited for rollouts only {wait:.0%} of its time; 2x needs "
                f"rollout >= training time at equal placement); engines idle {engines_idle:.0%}: the episodes' "
                "client threads share the trainer's cores, so requests reach the engines late")
    name = max(BUBBLES, key=lambda k: async_row[k])
    share = async_row[name] / max(async_row["elapsed_s"], 1e-9)
    return (f"{name} ({share:.0%} of the async trainer's time): {BUBBLES[name]}; trainer compute "
            f"{async_row['compute_s'] / max(async_row['elapsed_s'], 1e-9):.0%}, engines idle "
            f"{engines_idle:.0%}")


def plot(runs: dict, path: str) -> Optional[str]:
    """Cumulative reward over wall-clock seconds, every run of both modes; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, color in zip(MODES, ("tab:blue", "tab:orange")):
        for i, row in enumerate(runs[mode]):
            xs = [0.0] + [p[0] for p in row["reward_curve"]]
            ys = [0.0] + [p[1] for p in row["reward_curve"]]
            ax.plot(xs, ys, color=color, alpha=0.8, label=f"{mode} ({row['reward_per_s']:.3f} reward/s)"
                    if i == 0 else None)
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("cumulative reward of trained trajectories")
    ax.set_title("reward per wall-clock second, sync vs async (equal placement)")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
    parser.add_argument("--trainer-device", default=None, help="train.device of both modes, e.g. cpu:0")
    parser.add_argument("--engine-devices", default=None, help="rollout.devices of both modes, e.g. cpu:1")
    parser.add_argument("--admission", default=None, choices=("slots", "staleness"),
                        help="rollout.admission of the async runs (default: the config's)")
    parser.add_argument("--plot", default=None, help="PNG of the cumulative reward over wall-clock seconds")
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

    def med(mode: str, key: str) -> Optional[float]:
        values = [r[key] for r in runs[mode] if r[key] is not None]
        return median(values) if values else None

    per_repeat = [a["trained_tokens_per_s"] / s["trained_tokens_per_s"] for s, a in zip(runs["sync"], runs["async"])]
    speedup = med("async", "trained_tokens_per_s") / med("sync", "trained_tokens_per_s")
    idle = med("async", "trainer_idle_ratio_corrected")
    target_speedup, target_idle = 2.0, 0.20
    median_async = sorted(runs["async"], key=lambda r: r["trained_tokens_per_s"])[len(runs["async"]) // 2]
    median_sync = sorted(runs["sync"], key=lambda r: r["trained_tokens_per_s"])[len(runs["sync"]) // 2]
    result = {
        "command": "python " + " ".join(sys.argv), "config": args.config, "orders": orders,
        "inflight_trajectories": runs["sync"][0]["inflight_trajectories"], "runs": runs,
        "async_over_sync_trained_tokens_per_s": speedup,
        "async_over_sync_per_repeat": per_repeat, "async_over_sync_median_of_repeats": median(per_repeat),
        "trained_tokens_per_s_median": {m: med(m, "trained_tokens_per_s") for m in MODES},
        "trainer_idle_ratio_corrected_median": {m: med(m, "trainer_idle_ratio_corrected") for m in MODES},
        "trainer_idle_ratio_take_wait_median": {m: med(m, "trainer_idle_ratio_take_wait") for m in MODES},
        "engine_idle_ratio_median": {m: med(m, "engine_idle_ratio") for m in MODES},
        "dropped_fraction_median": {m: med(m, "dropped_fraction") for m in MODES},
        "reward_per_s_median": {m: med(m, "reward_per_s") for m in MODES},
        "targets": {"speedup": f">= {target_speedup}", "async_trainer_idle_ratio_corrected": f"<= {target_idle}",
                    "reward_per_s": "async >= sync"},
        "passed": speedup >= target_speedup and idle <= target_idle
        and med("async", "reward_per_s") >= med("sync", "reward_per_s"),
        "bubble": bubble(median_async, median_sync, speedup, target_speedup, target_idle),
        "loadavg_1min_end": os.getloadavg()[0],
    }
    if args.plot:
        result["plot"] = plot(runs, args.plot) or "not drawn: matplotlib is not installed"
    write_json(args.out, result, shown={k: v for k, v in result.items() if k != "runs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
