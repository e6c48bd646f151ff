"""Run metrics: one JSON line per trainer step, the same scalars in TensorBoard, and a PNG reward curve.

TensorBoard and matplotlib are optional (the ``[metrics]`` extra) and imported lazily; without them the
JSONL file is still written and the report says what was skipped.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional


class MetricsLogger:
    def __init__(self, out_dir: str, *, tensorboard: bool = True):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self._file = open(self.jsonl_path, "a", encoding="utf-8")
        self.rows: List[Dict] = []
        self._tb = None
        self.skipped: List[str] = []
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            except ImportError:
                self.skipped.append("tensorboard (not installed)")

    def log(self, step: int, values: Dict) -> None:
        row = {"step": step, **values}
        self.rows.append(row)
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            hist = values.get("staleness_histogram")
            if isinstance(hist, dict) and hist:
                import numpy

                flat = [int(k) for k, n in hist.items() for _ in range(int(n))]
                self._tb.add_histogram("staleness", numpy.array(flat), step)

    def reward_curve(self, path: Optional[str] = None, title: str = "reward") -> Optional[str]:
        """PNG of the batch reward (and eval reward where logged) against the trainer step."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.skipped.append("reward curve (matplotlib not installed)")
            return None
        path = path or os.path.join(self.out_dir, "reward_curve.png")
        fig, ax = plt.subplots(figsize=(7, 4))
        train = [(r["step"], r["reward"]) for r in self.rows if "reward" in r]
        if train:
            ax.plot(*zip(*train), alpha=0.35, label="batch reward")
            smooth = _moving_average([v for _, v in train], 10)
            ax.plot([s for s, _ in train], smooth, label="batch reward (moving avg 10)")
        evals = [(r["step"], r["eval_reward"]) for r in self.rows if "eval_reward" in r]
        if evals:
            ax.plot(*zip(*evals), "o-", label="eval reward (sampled, eval set)")
        greedy = [(r["step"], r["eval_greedy"]) for r in self.rows if "eval_greedy" in r]
        if greedy:
            ax.plot(*zip(*greedy), "s--", label="eval greedy accuracy")
        ax.set_xlabel("trainer step")
        ax.set_ylabel("mean reward")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _moving_average(values: List[float], window: int) -> List[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def idle_ratio_from_engines(before: Dict[str, Dict], after: Dict[str, Dict]) -> Optional[float]:
    """1 - (busy time / wall time) summed over engines between two ``/get_server_info`` snapshots.
    Engines replaced in between (pid changed), and engines that report no glm5 counters (SGLang has no
    ``busy_seconds``), are left out; None when no engine reports them."""
    busy = wall = 0.0
    keys = ("busy_seconds", "uptime_seconds")
    for name, a in after.items():
        b = before.get(name) or {}
        if not a or not b or a.get("pid") != b.get("pid") or not all(k in a and k in b for k in keys):
            continue
        busy += a["busy_seconds"] - b["busy_seconds"]
        wall += a["uptime_seconds"] - b["uptime_seconds"]
    return None if wall <= 0 else max(0.0, 1.0 - busy / wall)


def prefill_counters(infos: Dict[str, Dict]) -> Dict[str, float]:
    """Engine totals since start: prefill tokens computed / reused, busy and prefill seconds."""
    return {"prefill_tokens": sum(int(i.get("prefill_tokens", 0)) for i in infos.values()),
            "cached_tokens": sum(int(i.get("cached_tokens", 0)) for i in infos.values()),
            "busy_seconds": sum(float(i.get("busy_seconds", 0.0)) for i in infos.values()),
            "prefill_seconds": sum(float(i.get("prefill_seconds", 0.0)) for i in infos.values())}
