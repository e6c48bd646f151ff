"""What a rollout engine does with poison: requests that used to kill the scheduler, failing steps, bad weights."""
import pytest
import torch

from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest
from glm5_core.rl.serving.sampling import GREEDY_BELOW, check_training_temperature, sample, token_logprobs


def _request(rid, temperature=1.0, n=4):
    return GenerateRequest(rid, [1, 2, 3, 4, 5], temperature=temperature, max_new_tokens=n)


@pytest.mark.parametrize("temperature", [1e-39, 5e-7, 0.0])
def test_temperatures_below_the_greedy_floor_decode_greedily_instead_of_overflowing(temperature):
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.1, 0.9, 0.9]])
    temps = torch.full((2,), temperature)
    tokens, logprobs = sample(logits, temps, torch.ones(2), torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 2]  # argmax, lowest id among ties
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
    assert torch.isfinite(token_logprobs(logits, tokens, temperature)).all()


def test_training_refuses_temperatures_that_decode_greedily():
    with pytest.raises(ValueError, match="rollout.temperature"):
        check_training_temperature(GREEDY_BELOW / 2)
    assert check_training_temperature(GREEDY_BELOW) == GREEDY_BELOW


def test_a_tiny_temperature_request_no_longer_stops_the_engine(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=64).start()
    try:
        poison = engine.submit(_request("a", temperature=1e-39)).result(timeout=60)
        normal = engine.submit(_request("b")).result(timeout=60)
        assert len(poison.output_ids) == 4 and len(normal.output_ids) == 4
        assert engine.healthy()
    finally:
        engine.shutdown()


def test_a_failing_step_fails_every_pending_request_and_marks_the_engine_unhealthy(tiny_policy, monkeypatch):
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=64)  # 1 slot: the second request waits
    calls = {"n": 0}
    real_forward = engine._forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the prefill and one decode step succeed, then a step fails
            raise RuntimeError("device lost")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine, "_forward", failing_forward)
    futures = [engine.submit(_request("running", n=8)), engine.submit(_request("waiting", n=8))]
    engine.start()
    for future in futures:
        with pytest.raises(RuntimeError, match="device lost"):
            future.result(timeout=60)
    engine._thread.join(timeout=30)
    assert not engine.healthy() and isinstance(engine.failure, RuntimeError)
    assert engine.num_active() == 0 and len(engine.prefix_cache) == 0
    with pytest.raises(RuntimeError, match="scheduler failed"):
        engine.submit(_request("late"))
    engine.shutdown()


def test_a_failing_prefill_fails_the_admitted_requests(tiny_policy, monkeypatch):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=64)

    def broken_prefill(admitted):
        raise ValueError("bad prefill")

    monkeypatch.setattr(engine, "_prefill", broken_prefill)
    future = engine.submit(_request("a"))
    engine.start()
    with pytest.raises(ValueError, match="bad prefill"):
        future.result(timeout=60)
    engine.shutdown()


def test_weight_updates_must_be_finite_and_move_forward(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=32, weight_version=3)
    state = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    with pytest.raises(ValueError, match="versions only move forward"):
        engine.update_weights(state, 2)
    name = next(k for k, v in state.items() if v.is_floating_point())
    bad = dict(state)
    bad[name] = state[name].clone().fill_(float("nan"))
    with pytest.raises(ValueError, match="finite"):
        engine.update_weights(bad, 4)
    assert engine.version == 3
    engine.update_weights(state, 3)  # the same version again is allowed (a replica re-sent its weights)
    engine.update_weights(state, 5)
    assert engine.version == 5



def test_abort_drops_a_waiting_request_and_stops_a_running_one(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=64)  # driven by hand: no scheduler thread
    running = engine.submit(_request("running", n=30))
    waiting = engine.submit(_request("waiting", n=30))
    engine.step()  # admits "running" (prefill + one decode step); "waiting" has no slot
    engine.abort(waiting)
    engine.abort(running)
    assert waiting.cancelled()
    engine.step()
    result = running.result(timeout=0)
    assert result.finish_reason == "abort" and 1 <= len(result.output_ids) < 30
    assert engine.num_active() == 0 and not engine.has_work()
    assert engine.stats.requests == 1  # the cancelled request was never prefilled
    later = engine.submit(_request("later", n=3))
    engine.run_until_idle()
    assert later.result(timeout=0).finish_reason == "length" and not engine._aborted


def test_abort_after_the_request_finished_changes_nothing(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=64)
    done = engine.submit(_request("a", n=2))
    engine.run_until_idle()
    engine.abort(done)
    assert done.result(timeout=0).finish_reason == "length" and not engine._aborted


def test_an_older_version_pushed_while_newer_weights_are_being_applied_is_refused(tiny_policy, monkeypatch):
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=32, weight_version=3)
    state = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    load = tiny_policy.load_state_dict
    refused = []

    def load_while_an_old_push_arrives(*args, **kwargs):  # the window: pending cleared, version not yet set
        try:
            engine.update_weights(state, 4)
        except ValueError as exc:
            refused.append(str(exc))
        return load(*args, **kwargs)

    monkeypatch.setattr(tiny_policy, "load_state_dict", load_while_an_old_push_arrives)
    engine.update_weights(state, 6)  # no scheduler thread: applied at once
    monkeypatch.setattr(tiny_policy, "load_state_dict", load)
    assert engine.version == 6 and refused and "expected >= 6" in refused[0]
    engine.step()  # nothing pending: the refused push left no trace
    assert engine.version == 6


def test_a_failed_engine_refuses_weight_updates(tiny_policy, monkeypatch):
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=32)
    monkeypatch.setattr(engine, "_decode", lambda: (_ for _ in ()).throw(OSError("boom")))
    future = engine.submit(_request("x"))
    engine.start()
    with pytest.raises(OSError):
        future.result(timeout=60)
    engine._thread.join(timeout=30)
    with pytest.raises(RuntimeError, match="scheduler failed"):
        engine.update_weights({k: v.clone() for k, v in tiny_policy.state_dict().items()}, 1)
    engine.shutdown()
