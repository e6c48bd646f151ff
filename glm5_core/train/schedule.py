"""Stages and learning rates as pure functions of the global step (so a resumed run needs only the step).

Step ``s`` (0-based) falls in the stage whose cumulative step range holds it. The main model's learning rate
follows warm-up + decay over the steps of the ``dense`` and ``sparse`` stages counted together (it does not
move during ``indexer_warmup``, when the main model is frozen). The indexer's learning rate is a cosine from
``indexer_lr`` to ``indexer_final_lr`` within its stage, or the main learning rate where those are unset.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from glm5_core.train.config import ScheduleConfig, StageConfig

MAIN_STAGE_KINDS = ("dense", "sparse")


@dataclasses.dataclass(frozen=True)
class StagePoint:
    index: int  # which stage
    stage: StageConfig
    step_in_stage: int
    main_step: int  # steps of dense/sparse stages before this one (the main schedule's clock)


def _cosine(start: float, end: float, frac: float) -> float:
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * min(max(frac, 0.0), 1.0)))


class StageSchedule:
    def __init__(self, stages: list[StageConfig], schedule: ScheduleConfig):
        self.stages, self.cfg = stages, schedule
        self.total_steps = sum(s.steps for s in stages)
        self.main_steps = sum(s.steps for s in stages if s.kind in MAIN_STAGE_KINDS)

    def point(self, step: int) -> StagePoint:
        if not 0 <= step < self.total_steps:
            raise ValueError(f"step: expected 0 <= step < {self.total_steps}, got {step}")
        start = main = 0
        for i, stage in enumerate(self.stages):
            if step < start + stage.steps:
                within = step - start
                return StagePoint(i, stage, within, main + (within if stage.kind in MAIN_STAGE_KINDS else 0))
            start += stage.steps
            main += stage.steps if stage.kind in MAIN_STAGE_KINDS else 0
        raise AssertionError("unreachable: step range checked above")

    def main_lr(self, main_step: int) -> float:
        cfg = self.cfg
        if cfg.warmup_steps and main_step < cfg.warmup_steps:
            return cfg.lr * (main_step + 1) / cfg.warmup_steps
        if cfg.decay == "constant":
            return cfg.lr
        span = max(1, self.main_steps - cfg.warmup_steps)
        frac = (main_step - cfg.warmup_steps) / span
        floor = cfg.lr * cfg.min_lr_ratio
        if cfg.decay == "linear":
            return cfg.lr + (floor - cfg.lr) * min(frac, 1.0)
        return _cosine(cfg.lr, floor, frac)

    def lrs(self, step: int) -> dict:
        """``{"main": lr, "indexer": lr}`` at global step ``step``."""
        p = self.point(step)
        main = self.main_lr(p.main_step)
        indexer: Optional[float] = main
        if p.stage.indexer_lr is not None:
            frac = p.step_in_stage / max(1, p.stage.steps - 1)
            indexer = _cosine(p.stage.indexer_lr, p.stage.indexer_final_lr, frac)
        return {"main": main, "indexer": indexer}
