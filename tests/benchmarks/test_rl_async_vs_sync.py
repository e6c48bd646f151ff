"""benchmarks/rl_async_vs_sync.py: equal in-flight counts, alternating order, the trainer-time breakdown."""
import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "rl_async_vs_sync.py"


def _load():
    spec = importlib.util.spec_from_file_location("rl_async_vs_sync_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


def flags(**kw):
    return argparse.Namespace(**{**dict(batch_size=None, max_staleness=None), **kw})


@pytest.mark.parametrize("batch_size, groups", [(None, 4), (32, 8)])
def test_async_gets_the_in_flight_count_of_sync(tmp_path, batch_size, groups):
    # configs/rl_multiturn.yaml: batch 16, group size 4, max_inflight_groups 8 (32 trajectories) in the file
    base = bench.load_sections(str(ROOT / "configs" / "rl_multiturn.yaml"))
    cfg = bench.run_config(base, flags(batch_size=batch_size), "async", 3, str(tmp_path))
    assert cfg.rollout.max_inflight_groups == groups
    assert cfg.rollout.max_inflight_groups * cfg.rollout.group_size == cfg.train.batch_size
    assert (cfg.mode, cfg.max_steps) == ("async", 3)
    assert base["rollout"]["max_inflight_groups"] == 8  # the loaded file is not changed in place


def test_order_alternates_across_repeats():
    assert bench.round_orders(3) == [("sync", "async"), ("async", "sync"), ("sync", "async")]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_trainer_clock_counts_compute_push_and_in_loop_eval(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(bench.time, "monotonic", clock)

    def spends(seconds):
        def call(*args, **kwargs):
            clock.now += seconds
        return call

    trainer = argparse.Namespace(train_step=spends(2.0))
    run = argparse.Namespace(trainer=trainer, _push_weights=spends(1.0), evaluate=spends(3.0),
                             runner=argparse.Namespace(stop=spends(0.0)))
    timer = bench.TrainerClock(run)
    run.evaluate()  # step-0 eval, before the loop: not counted
    run.trainer.train_step([])
    run._push_weights()
    run.evaluate()  # in the loop: counted
    run.trainer.train_step([])
    run.runner.stop()
    run.evaluate()  # final eval, after the loop: not counted
    parts = timer.breakdown({"elapsed_s": 20.0, "trainer_idle_ratio": 0.5})
    assert parts["take_wait_s"] == pytest.approx(10.0)
    assert (parts["compute_s"], parts["push_s"], parts["eval_s"]) == (4.0, 1.0, 3.0)
    assert parts["other_s"] == pytest.approx(2.0)
    assert parts["trainer_idle_ratio_take_wait"] == 0.5
    assert parts["trainer_idle_ratio_corrected"] == pytest.approx(0.8)  # 1 - 4 / 20: push and eval are idle


def test_median_of_an_even_count_is_the_mean_of_the_middle_two():
    assert bench.median([3.0, 1.0, 4.0, 2.0]) == 2.5
    assert bench.median([3.0, 1.0, 2.0]) == 2.0


def test_both_modes_get_the_same_placement_and_async_the_admission(tmp_path):
    base = bench.load_sections(str(ROOT / "configs" / "rl_longtail.yaml"))
    args = flags(trainer_device="cpu:0", engine_devices="cpu:1", admission="slots")
    for mode in bench.MODES:
        cfg = bench.run_config(base, args, mode, 2, str(tmp_path))
        assert (cfg.train.device, cfg.rollout.devices, cfg.rollout.admission) == ("cpu:0", "cpu:1", "slots")
        assert cfg.rollout.max_inflight_groups * cfg.rollout.group_size == cfg.train.batch_size


def test_outcomes_and_the_named_bubble(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "reward": 0.25, "elapsed_s": 2.0}\n{"step": 2, "reward": 0.5, "elapsed_s": 4.0}\n')
    curve = bench.reward_curve(str(metrics), batch_size=4)
    assert curve == [(2.0, 1.0), (4.0, 3.0)]
    summary = {"issued_trajectories": 10, "dropped_stale": 1, "env_failures": 1, "rollout_failures": 0,
               "dropped_malformed": 0, "rollout_idle_ratio": 0.3, "elapsed_s": 4.0}
    out = bench.outcomes(summary, curve)
    assert (out["dropped_fraction"], out["dropped_stale_fraction"], out["reward_per_s"]) == (0.2, 0.1, 0.75)
    row = {"elapsed_s": 10.0, "take_wait_s": 6.0, "compute_s": 3.0, "push_s": 0.5, "eval_s": 0.0, "other_s": 0.5,
           "trainer_idle_ratio_corrected": 0.7, "engine_idle_ratio": 0.1, "steps": 4}
    sync = dict(row, elapsed_s=20.0, take_wait_s=8.0)
    assert bench.bubble(row, sync, 1.2, 2.0, 0.2).startswith("take_wait_s (60% of the async trainer's time)")
    assert bench.bubble(dict(row, trainer_idle_ratio_corrected=0.1), sync, 2.5, 2.0, 0.2) is None
    busy = dict(row, compute_s=9.0, push_s=1.0, take_wait_s=0.0, trainer_idle_ratio_corrected=0.1)
    assert bench.bubble(busy, sync, 1.5, 2.0, 0.2).startswith(
        "trainer compute-bound: the async trainer computes 90% of its time, so async can be at most ~2.00x sync "
        "here (sync waited for rollouts only 40% of its time")
