import pytest

from glm5_core.rl.algorithm.buffer import TrajectoryBuffer
from glm5_core.rl.rollout.gateway import TITOGateway
from glm5_core.rl.rollout.trajectory import Sample, Trajectory


class FakeEngine:
    """Answers with fixed tokens and records what it was sent."""

    def __init__(self, outputs, version=3):
        self.outputs = list(outputs)
        self.version = version
        self.requests = []

    def __call__(self, tid, request):
        self.requests.append((tid, request))
        out = self.outputs.pop(0)
        return {"output_ids": out, "meta_info": {
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(out)],
            "finish_reason": {"type": "stop"}, "weight_version": self.version}}


def test_gateway_records_tokens_masks_logprobs_versions_without_retokenising():
    engine = FakeEngine([[7, 8], [9]])
    gw = TITOGateway("t1", engine)
    gw.generate([1, 2, 3], {"max_new_tokens": 2})
    gw.generate([1, 2, 3, 7, 8, 4, 5], {"max_new_tokens": 1})  # previous turn + env tokens 4, 5
    (sample,) = gw.finished_samples()
    assert sample.tokens == [1, 2, 3, 7, 8, 4, 5, 9]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert sample.logprobs == [0, 0, 0, -0.5, -1.5, 0, 0, -0.5]
    assert sample.versions == [-1, -1, -1, 3, 3, -1, -1, 3]
    assert sample.finish_reasons == ["stop", "stop"]
    assert engine.requests[1][1]["input_ids"] == [1, 2, 3, 7, 8, 4, 5]
    assert all(r["rid"] == "t1" and r["return_logprob"] for _, r in engine.requests)


def test_gateway_opens_a_new_sample_when_context_is_rewritten():
    gw = TITOGateway("t", FakeEngine([[7], [8]]))
    gw.generate([1, 2, 3], {})
    gw.generate([1, 9, 7], {})  # history folded: not an extension
    a, b = gw.finished_samples()
    assert a.tokens == [1, 2, 3, 7] and b.tokens == [1, 9, 7, 8]
    assert b.loss_mask == [0, 0, 0, 1]


def test_gateway_rejects_inconsistent_engine_response():
    def bad(tid, req):
        return {"output_ids": [5], "meta_info": {"output_token_logprobs": [[-1.0, 6, None]],
                                                   "finish_reason": {"type": "stop"}, "weight_version": 0}}

    with pytest.raises(ValueError, match="do not match"):
        TITOGateway("t", bad).generate([1], {})


def traj(tid, group, version, reward=1.0, failed=False):
    s = Sample()
    s.append([1, 2], sampled=False)
    s.append([3], sampled=True, logprobs=[-1.0], versions=[version])
    return Trajectory(tid, group, [s], reward, env_failed=failed)


def test_buffer_waits_for_threshold_drops_stale_and_counts_exactly_once():
    buf = TrajectoryBuffer(batch_size=4, group_size=2, max_staleness=1)
    buf.put(traj("a0", "a", 0))
    buf.put(traj("b0", "b", 5))
    buf.put(traj("b1", "b", 5))
    assert buf.take(policy_version=5, timeout=0) is None  # group a incomplete, only 2 ready
    buf.put(traj("a1", "a", 0))
    assert buf.take(policy_version=5, timeout=0) is None  # group a is 5 versions old: dropped
    assert buf.dropped_stale == 2 and sorted(buf.dropped_ids) == ["a0", "a1"]
    buf.put(traj("c0", "c", 4))
    buf.put(traj("c1", "c", 4))
    batch = buf.take(policy_version=5, timeout=0)
    assert sorted(t.trajectory_id for t in batch) == ["b0", "b1", "c0", "c1"]
    assert buf.staleness_histogram == {0: 2, 1: 2}
    with pytest.raises(RuntimeError, match="put twice"):
        buf.put(traj("b0", "b", 5))


def test_buffer_skips_groups_with_environment_failures():
    buf = TrajectoryBuffer(batch_size=2, group_size=2)
    buf.put(traj("x0", "x", 0, failed=True))
    buf.put(traj("x1", "x", 0))
    assert buf.take(0, timeout=0) is None
    assert buf.dropped_env_failures == 2


def test_a_trajectory_that_sampled_nothing_does_not_make_its_fresh_group_stale():
    # its oldest_version is -1 (no sampled token): read as a version, it was policy_version + 1 behind, so the
    # whole fresh group was dropped as stale once policy_version >= max_staleness, and the histogram got p + 1
    buf = TrajectoryBuffer(batch_size=2, group_size=2, max_staleness=1)
    buf.put(traj("a0", "a", 5))
    buf.put(Trajectory("a1", "a", [], 0.0))  # e.g. its prompt filled max_len: no generation
    batch = buf.take(policy_version=5, timeout=0)
    assert batch is not None and sorted(t.trajectory_id for t in batch) == ["a0", "a1"]
    assert buf.dropped_stale == 0 and buf.staleness_histogram == {0: 1}


def test_staleness_leaves_out_trajectories_that_sampled_nothing():
    from glm5_core.rl.algorithm.buffer import staleness

    batch = [traj("a0", "a", 3), Trajectory("a1", "a", [], 0.0), traj("b0", "b", 5)]
    assert staleness(batch, policy_version=5) == [2, 0]
    assert staleness([Trajectory("c0", "c", [], 0.0)], policy_version=5) == []


def test_buffer_argument_checks():
    with pytest.raises(ValueError, match="group_size"):
        TrajectoryBuffer(batch_size=5, group_size=2)
    with pytest.raises(ValueError, match="max_staleness"):
        TrajectoryBuffer(batch_size=2, group_size=2, max_staleness=-1)
