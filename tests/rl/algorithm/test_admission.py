"""Staleness-paced admission (``rollout.admission: staleness``, AReaL's staleness manager made exact): with
long-tailed trajectory lengths, every admitted group is trained within ``max_staleness`` versions of the weights
it started under and none is dropped; the default (start whenever a slot is free) drops stale work."""
import random

import pytest

from glm5_core.rl.algorithm.buffer import TrajectoryBuffer
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.rollout.trajectory import Sample, Trajectory


def trajectory(group_id: str, i: int, versions: list[int]) -> Trajectory:
    sample = Sample()
    sample.append([1], sampled=False)
    sample.append([5] * len(versions), sampled=True, logprobs=[-1.0] * len(versions), versions=versions)
    return Trajectory(f"{group_id}-{i}", group_id, [sample], 1.0)


def simulate(admission: bool, *, ticks: int = 400, tau: int = 1, batch: int = 4, group: int = 2,
             slots: int = 6, seed: int = 0):
    """A producer keeps up to ``slots`` groups running (admitted as the buffer allows); each runs a long-tailed
    number of ticks (1 .. 40, Pareto-like) and samples its tokens under the versions the engines hold while it
    runs (partial rollout: the first token under the version it started with); the trainer takes a batch
    whenever it can, one version a take, and pushes at once."""
    rng = random.Random(seed)
    buf = TrajectoryBuffer(batch_size=batch, group_size=group, max_staleness=tau, admission=admission)
    version, running, next_group, admitted, trained = 0, {}, 0, {}, []
    for tick in range(ticks):
        while len(running) < slots:
            gid = f"g{next_group}"
            if not buf.try_admit(gid, version, version):
                break
            next_group += 1
            running[gid] = (version, tick + min(40, int(rng.paretovariate(1.0))))
            admitted[gid] = version
        for gid, (start, end) in list(running.items()):
            if tick >= end:
                del running[gid]
                for i in range(group):
                    buf.put(trajectory(gid, i, [start, version]))
        taken = buf.take(version, timeout=0)
        if taken is not None:
            trained += [(t.group_id, version) for t in taken]
            version += 1
    return buf, admitted, trained, version


def test_admission_never_trains_a_group_past_max_staleness_and_drops_none():
    for seed in range(3):
        buf, admitted, trained, version = simulate(True, seed=seed)
        assert version > 20  # the run made progress
        assert buf.dropped_stale == 0 and buf.dropped_ids == []
        for gid, at in trained:
            assert at - admitted[gid] <= buf.max_staleness  # trained within max_staleness of its start weights
        assert max(buf.staleness_histogram) <= buf.max_staleness
        untrained = set(admitted) - {gid for gid, _ in trained}
        assert untrained == set(buf._deadlines)  # every admitted group is trained or still waiting, none lost
        assert buf.admission_refusals > 0  # the pacing did hold groups back


def test_without_admission_the_same_workload_drops_stale_work():
    buf, _, _, _ = simulate(False)
    assert buf.dropped_stale > 0


def test_admission_refuses_when_the_deadline_cannot_be_met():
    buf = TrajectoryBuffer(batch_size=2, group_size=2, max_staleness=0, admission=True)
    assert buf.try_admit("g0", 0, 0)  # fills the take at version 0
    assert not buf.try_admit("g1", 0, 0)  # would have to be trained at version 0 too: no room
    for i in range(2):
        buf.put(trajectory("g0", i, [0]))
    assert [t.group_id for t in buf.take(0, timeout=0)] == ["g0", "g0"]
    assert buf.try_admit("g1", 1, 1)


def test_the_config_option_and_its_rules(tmp_path):
    cfg = config_from_dict({"output_dir": str(tmp_path), "mode": "async", "rollout": {"admission": "staleness"}})
    assert cfg.rollout.admission == "staleness"
    with pytest.raises(ValueError, match=r"rollout.admission: 'staleness' paces admission by train.max_staleness"):
        config_from_dict({"output_dir": str(tmp_path), "rollout": {"admission": "staleness"},
                          "train": {"max_staleness": None}})
    with pytest.raises(ValueError, match=r"rollout.admission"):
        config_from_dict({"output_dir": str(tmp_path), "rollout": {"admission": "eager"}})


@pytest.mark.slow  # a whole async run with engine processes (~1 min on 2 shared cores); the rule: the tests above
def test_an_async_run_with_staleness_admission_drops_nothing(tmp_path):
    from glm5_core.rl.driver import RLRun

    cfg = config_from_dict({
        "seed": 0, "mode": "async", "output_dir": str(tmp_path), "max_minutes": 5, "max_steps": 4,
        "env": {"name": "calculator", "max_numbers": 4, "pareto_alpha": 1.0, "max_new_tokens": 4},
        "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
        "rollout": {"num_engines": 1, "max_batch": 8, "max_len": 128, "group_size": 2, "max_inflight_groups": 4,
                    "admission": "staleness"},
        "train": {"batch_size": 4, "max_staleness": 0, "mask_offpolicy": "partial"},
        "eval": {"every": 0, "samples_per_problem": 1}})
    summary = RLRun(cfg, log=lambda m: None).run()
    assert summary["steps"] == 4 and summary["dropped_stale"] == 0
    assert summary["staleness_histogram"] == {"0": 16}
    assert summary["admission_refusals"] > 0 and "masked_offpolicy_tokens" in summary
