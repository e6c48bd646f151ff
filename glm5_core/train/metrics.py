"""Run metrics: one JSON object per step in ``metrics.jsonl``, the same scalars in TensorBoard, and a PNG
of the loss curve at the end (stages shaded). Only rank 0 writes.

A resumed run appends to ``metrics.jsonl`` after dropping records at or past the resume step, so the
file always holds one record per step of the run's history.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
SMOOTHING = 20  # steps in the plot's moving mean


def load_balance(expert_counts: torch.Tensor) -> Optional[float]:
    """Max over mean tokens per expert, averaged over MoE layers (1.0 = perfectly balanced)."""
    if expert_counts.numel() == 0:
        return None
    counts = expert_counts.to(torch.float64)  # [layers, E]
    mean = counts.mean(dim=-1).clamp_min(1e-12)
    return float((counts.max(dim=-1).values / mean).mean())


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class MetricsLogger:
    def __init__(self, output_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = output_dir / METRICS_FILE
        self.output_dir = output_dir
        self._tb = None
        self.skipped: list[str] = []  # optional outputs whose package is missing (the [metrics] extra)
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_records(self.path) if r.get("step", 0) <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                SummaryWriter = None
                self.skipped.append("tensorboard (not installed)")
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resume_step + 1)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values (fewer at the start); NaN where the value itself is NaN."""
    out = []
    for i, v in enumerate(values):
        recent = [x for x in values[max(0, i - window + 1):i + 1] if not math.isnan(x)]
        out.append(math.nan if math.isnan(v) else sum(recent) / len(recent))
    return out


def _stage_segments(records: list[dict]) -> list[tuple]:
    """(stage, first step, last step) of each run of consecutive records in one stage."""
    segments: list[list] = []
    for r in records:
        if segments and segments[-1][0] == r["stage"]:
            segments[-1][2] = r["step"]
        else:
            segments.append([r["stage"], r["step"], r["step"]])
    return [tuple(s) for s in segments]


def plot_losses(metrics_path: Path, out_path: Path, title: Optional[str] = None) -> Optional[Path]:
    """Loss per step, one colour band per stage (``title`` above it: a partial run says so there). Returns the
    PNG path, or None without matplotlib/records."""
    records = read_records(metrics_path)
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [r["step"] for r in records]
    for n, (key, label) in enumerate((("lm_loss", "LM loss"), ("mtp_loss", "MTP loss"), ("indexer_kl", "indexer KL"))):
        values = [math.nan if r.get(key) is None else r[key] for r in records]  # NaN breaks the line
        if all(math.isnan(v) for v in values):
            continue
        ax.plot(steps, values, label=label, linewidth=0.6, alpha=0.45, color=f"C{n}")
        ax.plot(steps, _moving_mean(values, SMOOTHING), label=f"{label} ({SMOOTHING}-step mean)", linewidth=1.6,
                color=f"C{n}")
    top = ax.get_ylim()[1]
    for n, (stage, first, last) in enumerate(_stage_segments(records)):
        ax.axvspan(first, last, alpha=0.08, color=f"C{n + 3}")
        ax.text(first, top * (1.0 - 0.05 * (n % 2)), f" {stage}", va="top", fontsize=8)  # staggered: no overlap
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
