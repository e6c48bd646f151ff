"""Stage boundaries and learning rates as functions of the global step."""
import math

import pytest

from glm5_core.train.config import ScheduleConfig, StageConfig
from glm5_core.train.schedule import StageSchedule

STAGES = [StageConfig("dense", 10), StageConfig("indexer_warmup", 5, indexer_lr=5e-3, indexer_final_lr=2e-4),
          StageConfig("sparse", 10)]


def test_stage_points_and_main_clock():
    s = StageSchedule(STAGES, ScheduleConfig(lr=1e-2, warmup_steps=2))
    kinds = [s.point(i).stage.kind for i in range(25)]
    assert kinds == ["dense"] * 10 + ["indexer_warmup"] * 5 + ["sparse"] * 10
    assert [s.point(i).main_step for i in (9, 10, 14, 15, 24)] == [9, 10, 10, 10, 19]
    with pytest.raises(ValueError, match="step"):
        s.point(25)


def test_main_lr_warms_up_then_decays_and_pauses_during_indexer_warmup():
    cfg = ScheduleConfig(lr=1e-2, warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    s = StageSchedule(STAGES, cfg)
    main = [s.lrs(i)["main"] for i in range(25)]
    assert main[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert main[4] == pytest.approx(1e-2)
    assert all(a >= b for a, b in zip(main[4:10], main[5:10]))
    assert len(set(main[10:15])) == 1  # main clock stopped
    assert main[15] < main[9]
    # last main step: cosine at (19 - 4) / 16 of the way from lr to lr * 0.1
    floor = 1e-3
    assert main[24] == pytest.approx(floor + (1e-2 - floor) * 0.5 * (1 + math.cos(math.pi * 15 / 16)))


def test_indexer_lr_runs_its_own_cosine_then_follows_the_main_lr():
    s = StageSchedule(STAGES, ScheduleConfig(lr=1e-2, warmup_steps=0, decay="linear", min_lr_ratio=0.0))
    idx = [s.lrs(i)["indexer"] for i in range(10, 15)]
    assert idx[0] == pytest.approx(5e-3) and idx[-1] == pytest.approx(2e-4)
    assert all(a > b for a, b in zip(idx, idx[1:]))
    assert s.lrs(20)["indexer"] == s.lrs(20)["main"]
    assert s.lrs(24)["main"] == pytest.approx(1e-2 * (1 - 19 / 20))
