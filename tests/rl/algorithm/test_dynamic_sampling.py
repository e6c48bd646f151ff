"""Dynamic sampling (equal-reward groups held back, more groups sampled, capped rounds) and truncation
(recorded per trajectory from the engine's finish reason; trained as is, masked or penalised)."""
import pytest

from glm5_core.rl.algorithm.buffer import TrajectoryBuffer
from glm5_core.rl.algorithm.dynamic_sampling import DynamicSampler, has_signal
from glm5_core.rl.algorithm.truncation import for_training, penalized
from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv
from glm5_core.rl.rollout.runner import RolloutRunner
from glm5_core.rl.rollout.trajectory import Sample, Trajectory


def _trajectory(group: str, i: int, reward: float, *, truncated=False, env_failed=False, version=0):
    s = Sample()
    s.append([1, 2], sampled=False)
    s.append([3], sampled=True, logprobs=[-0.1], versions=[version])
    return Trajectory(f"{group}-{i}", group, [s], reward, truncated=truncated, env_failed=env_failed)


def _put_group(buffer, group, rewards, **kwargs):
    for i, r in enumerate(rewards):
        buffer.put(_trajectory(group, i, r, **kwargs))


def test_has_signal_is_false_exactly_when_every_reward_is_equal():
    assert has_signal([_trajectory("g", 0, 1.0), _trajectory("g", 1, 0.0)])
    assert not has_signal([_trajectory("g", 0, 1.0), _trajectory("g", 1, 1.0)])
    assert not has_signal([_trajectory("g", 0, 0.3)])


def test_equal_reward_groups_are_held_back_and_dropped_once_a_batch_is_taken():
    buffer = TrajectoryBuffer(batch_size=4, group_size=2, dynamic_max_rounds=3)
    _put_group(buffer, "a", [1.0, 1.0])
    _put_group(buffer, "b", [0.0, 1.0])
    _put_group(buffer, "c", [0.0, 0.0])
    assert buffer.num_ready() == 2 and buffer.take(0, timeout=0) is None  # only b has a signal
    _put_group(buffer, "d", [1.0, 0.0])
    batch = buffer.take(0, timeout=0)
    assert [t.group_id for t in batch] == ["b", "b", "d", "d"]
    counters = buffer.dynamic.counters()
    assert counters == {"dynamic_dropped_groups": 2, "dynamic_filled_groups": 0,
                        "dynamic_dropped_by_reward": {"0": 1, "1": 1}}
    assert sorted(buffer.dropped_ids) == ["a-0", "a-1", "c-0", "c-1"] and buffer.leftover_ids() == []


def test_sync_last_round_fills_the_batch_with_held_back_groups():
    buffer = TrajectoryBuffer(batch_size=4, group_size=2, dynamic_max_rounds=2)
    _put_group(buffer, "a", [1.0, 1.0])
    _put_group(buffer, "b", [0.0, 1.0])
    _put_group(buffer, "c", [0.0, 0.0])
    assert buffer.take(0, timeout=0) is None
    batch = buffer.take(0, timeout=0, fill_held=True)
    assert [t.group_id for t in batch] == ["b", "b", "a", "a"]  # the oldest held-back group fills the gap
    assert buffer.dynamic.filled_groups == 1 and buffer.dynamic.dropped_groups == 1
    assert buffer.dropped_ids == ["c-0", "c-1"]


def test_async_rounds_are_counted_in_finished_groups():
    """A round is a batch's worth (batch_size / group_size = 2) of finished groups: after max_rounds = 2
    rounds (4 groups) held-back groups may fill the batch without the caller saying so."""
    buffer = TrajectoryBuffer(batch_size=4, group_size=2, dynamic_max_rounds=2)
    for name in "abc":
        _put_group(buffer, name, [1.0, 1.0])
    assert buffer.take(0, timeout=0) is None
    _put_group(buffer, "d", [1.0, 0.0])  # the 4th finished group: rounds spent
    batch = buffer.take(0, timeout=0)
    assert [t.group_id for t in batch] == ["d", "d", "a", "a"]
    assert buffer.dynamic.completed_since_take == 0 and buffer.dynamic.dropped_groups == 2


def test_without_dynamic_sampling_equal_reward_groups_train():
    buffer = TrajectoryBuffer(batch_size=4, group_size=2)
    _put_group(buffer, "a", [1.0, 1.0])
    _put_group(buffer, "b", [0.0, 0.0])
    assert [t.group_id for t in buffer.take(0, timeout=0)] == ["a", "a", "b", "b"] and buffer.dynamic is None


def test_held_back_groups_go_stale_like_any_other():
    buffer = TrajectoryBuffer(batch_size=2, group_size=2, max_staleness=1, dynamic_max_rounds=1)
    _put_group(buffer, "a", [1.0, 1.0], version=0)
    assert buffer.take(5, timeout=0, fill_held=True) is None  # 'a' is 5 versions old: dropped, not filled
    assert buffer.dropped_stale == 2 and buffer.dynamic.held == []


def test_environment_failed_groups_are_not_held_back():
    sampler = DynamicSampler(max_rounds=1, groups_per_batch=1)
    assert sampler.admit([_trajectory("g", 0, 0.0, env_failed=True), _trajectory("g", 1, 0.0)])


def test_dynamic_sampling_needs_groups_of_two(monkeypatch):
    from glm5_core.config_schema import ConfigError
    from glm5_core.rl.config_loader import config_from_dict

    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    with pytest.raises(ConfigError, match="dynamic_sampling.enabled: expected rollout.group_size >= 2"):
        config_from_dict({"dynamic_sampling": {"enabled": True}, "rollout": {"group_size": 1},
                          "train": {"batch_size": 8}})
    with pytest.raises(ConfigError, match=r"dynamic_sampling.max_rounds: expected an integer in \[1, 1000\]"):
        config_from_dict({"dynamic_sampling": {"enabled": True, "max_rounds": 0}})


def _length_generate(finish):
    """A fake engine answering ``max_new_tokens`` tokens with finish reason ``finish``."""
    def generate(trajectory_id, request):
        n = request["sampling_params"]["max_new_tokens"]
        ids = [48 + i % 10 for i in range(n)]
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids],
                                                 "finish_reason": {"type": finish}, "weight_version": 0}}
    return generate


@pytest.mark.parametrize("max_len,finish,truncated", [
    (64, "length", False),  # stopped by the environment's own max_new_tokens: its task, not a truncation
    (6, "length", True),  # prompt '1+2=' is 4 tokens: max_len 6 leaves 2 of the 3 new tokens asked for
    (6, "stop", False),  # clipped budget, but the engine stopped on its own
    (4, "length", True),  # no room for a single new token
])
def test_the_runner_records_truncation_by_max_len(max_len, finish, truncated):
    env = ArithmeticEnv(max_operand=9, max_new_tokens=3, held_out=0.0)
    runner = RolloutRunner(env, _length_generate(finish), group_size=1, temperature=1.0, top_p=1.0,
                           max_len=max_len, max_workers=1)
    try:
        [trajectory] = runner.run_groups(1)
    finally:
        runner.shutdown()
    assert trajectory.truncated is truncated


def test_truncation_policies():
    cut, whole = _trajectory("g", 0, 1.0, truncated=True), _trajectory("g", 1, 0.0)
    assert penalized(cut, "penalize", -1.0).reward == -1.0 and penalized(whole, "penalize", -1.0).reward == 0.0
    assert penalized(cut, "as_is", -1.0) is cut and penalized(cut, "mask", -1.0) is cut
    masked = for_training([cut, whole], "mask")
    assert masked[0].samples[0].loss_mask == [0, 0, 0] and masked[0].reward == 1.0
    assert masked[1] is whole and cut.samples[0].loss_mask == [0, 0, 1]  # the buffer's copy is left alone
    assert for_training([cut, whole], "as_is") == [cut, whole]
