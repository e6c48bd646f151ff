"""Run metrics: one JSON line per trainer step, the same scalars in TensorBoard, and a PNG reward curve.

TensorBoard and matplotlib are optional (the ``[metrics]`` extra) and imported lazily; without them the
JSONL file is still written and the report says what was skipped.

A resumed run (``resume_step``) keeps the rows of its steps up to the resume point (the run's summary rows and
anything logged after that step go), rewrites the file with them and appends; the reward curve covers them.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from glm5_core.safe_files import parse_json, read_bytes

MAX_METRICS_BYTES = 1 << 28  # metrics.jsonl a resume reads back: ~1 KB a step


def rows_up_to(path: str, step: int) -> list[dict]:
    """The step rows of an earlier run's ``metrics.jsonl`` (``path``, untrusted) at steps <= ``step``, summaries
    left out; a last line cut short by a kill is skipped, any other bad line is a ValueError naming it."""
    if not os.path.lexists(path):
        return []
    lines = read_bytes(path, root=os.path.dirname(path), max_bytes=MAX_METRICS_BYTES).split(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{path}:{number}")
        except ValueError:
            if number == len(lines):  # no newline after it: the write a kill interrupted
                continue
            raise
        if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number}: expected an object with an int step, got {line[:60]!r}")
        if row["step"] <= step and "summary" not in row:
            rows.append(row)
    return rows


class MetricsLogger:
    def __init__(self, out_dir: str, *, tensorboard: bool = True, resume_step: Optional[int] = None):
        """``resume_step``: continue a resumed run's file from that step (-1: from the start)."""
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self.rows: list[dict] = []
        if resume_step is not None:
            self.rows = rows_up_to(self.jsonl_path, resume_step)
            tmp = f"{self.jsonl_path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(json.dumps(row, sort_keys=True) + "\n" for row in self.rows))
            os.replace(tmp, self.jsonl_path)
        self._file = open(self.jsonl_path, "a", encoding="utf-8")
        self._tb = None
        self.skipped: list[str] = []
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resume_step is None else resume_step + 1  # events past the resume point go
                self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=purge)
            except ImportError:
                self.skipped.append("tensorboard (not installed)")

    def log(self, step: int, values: dict) -> None:
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


def _moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def idle_ratio_from_engines(before: dict[str, dict], after: dict[str, dict]) -> Optional[float]:
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


def prefill_counters(infos: dict[str, dict]) -> dict[str, float]:
    """Engine totals since start: prefill tokens computed / reused, busy and prefill seconds."""
    return {"prefill_tokens": sum(int(i.get("prefill_tokens", 0)) for i in infos.values()),
            "cached_tokens": sum(int(i.get("cached_tokens", 0)) for i in infos.values()),
            "busy_seconds": sum(float(i.get("busy_seconds", 0.0)) for i in infos.values()),
            "prefill_seconds": sum(float(i.get("prefill_seconds", 0.0)) for i in infos.values())}
