"""A generation the fleet gave up on (retries spent) drops its trajectory instead of ending the run; a request
the engines reject as malformed (4xx) is a bug and still raises."""
import pytest

from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv
from glm5_core.rl.rollout.runner import RolloutRunner
from glm5_core.rl.serving.client import EngineRequestError, EngineUnavailable


def fake_generate(fail):
    def generate(trajectory_id, request):
        if trajectory_id in fail:
            raise fail[trajectory_id]
        n = len(request["input_ids"])
        return {"output_ids": [48 + n % 10], "meta_info": {"output_token_logprobs": [[-0.5, 48 + n % 10, None]],
                                                          "finish_reason": {"type": "length"}, "weight_version": 0,
                                                          "token_weight_versions": [0]}}
    return generate


@pytest.mark.parametrize("error", [EngineUnavailable("engine0: connection refused"),
                                   EngineRequestError(500, "RuntimeError: device lost"),
                                   EngineRequestError(504, "not finished within 600s")])
def test_a_generation_that_failed_everywhere_drops_its_trajectory(error):
    runner = RolloutRunner(ArithmeticEnv(max_operand=3, max_new_tokens=1), fake_generate({"g0-1": error}),
                           group_size=2, temperature=1.0, top_p=1.0, max_len=64, max_workers=2)
    try:
        trajectories = {t.trajectory_id: t for t in runner.run_groups(2)}
    finally:
        runner.shutdown()
    assert set(trajectories) == {"g0-0", "g0-1", "g1-0", "g1-1"}
    assert trajectories["g0-1"].env_failed and trajectories["g0-1"].reward == 0.0
    assert not any(trajectories[t].env_failed for t in ("g0-0", "g1-0", "g1-1"))
    assert runner.rollout_failures == 1 and runner.env_failures == 0


def test_a_malformed_request_still_raises():
    runner = RolloutRunner(ArithmeticEnv(max_operand=3, max_new_tokens=1),
                           fake_generate({"g0-0": EngineRequestError(400, "input_ids[0]: expected a token id")}),
                           group_size=1, temperature=1.0, top_p=1.0, max_len=64, max_workers=1)
    try:
        with pytest.raises(EngineRequestError, match="input_ids"):
            runner.run_groups(1)
    finally:
        runner.shutdown()
