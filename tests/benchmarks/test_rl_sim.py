"""benchmarks/rl_sim.py against schedules computed by hand.

Every case: one engine with 2 slots, one training accelerator, batch 2, 2 trainer steps, push 0.5 s and
    decode step time = dec_fixed + dec_per_seq * active = 1 + 0.5 * b  ->  2 s with 2 active, 1.5 s with 1
    train time = 0.1 s per token
Trajectories are named by their generated-token count (A=5 means A generates 5 tokens).
"""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_sim.py"
COST = {"dec_fixed": 1.0, "dec_per_seq": 0.5, "train_per_token": 0.1}


def _load_sim():
    spec = importlib.util.spec_from_file_location("rl_sim_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


sim = _load_sim()


def cluster(**kw):
    return sim.Cluster(**{**dict(rollout=1, train=1, slots=2, batch=2, iterations=2, staleness=1, push_seconds=0.5),
                          **kw})


def steps(result):
    return [(pytest.approx(s["start_s"]), pytest.approx(s["end_s"]), s["tokens"]) for s in result["trainer_steps"]]


def test_async_credits_the_trajectory_that_finished():
    # pool A=5, B=2, C=4, D=3; staleness 1 -> bound (0 + 1 + 1) * 2 = 4: all four may start before step 1.
    # t=0    admit A, B. 2 active (2 s/token); B ends first: 2 tokens -> t=4.
    # t=4    B done (ready [B=2]); A has 3 left. Admit C (4 left). Next end: A after 3 tokens -> t=10.
    # t=10   A done (ready [2, 5]); C has 1 left. Admit D. Trainer takes [2, 5] = 7 tokens:
    #        0.7 s + push 0.5 s -> ends t=11.2. (Crediting the shortest pending lengths instead would take
    #        C's 4, not A's 5: a 6-token step ending at 11.1.)
    # t=12   C done after 1 token (2 active): ready [4]; D has 2 left, now alone: 1.5 s/token -> t=15.
    # t=15   D done: ready [4, 3] -> step 2: 7 tokens, t=15 -> 16.2. The run ends at 16.2, 14 tokens trained.
    r = sim.simulate_async(cluster(), COST, [5, 2, 4, 3])
    assert steps(r) == [(10.0, 11.2, 7), (15.0, 16.2, 7)]
    assert r["wall_s"] == pytest.approx(16.2)
    assert r["trained_tokens"] == 14
    # slot occupancy: [0, 4] 2/2, [4, 10] 2/2, [10, 12] 2/2, [12, 15] 1/2 -> 4 + 6 + 2 + 1.5 = 13.5 s
    assert r["rollout_utilisation"] == pytest.approx(13.5 / 16.2)
    assert r["trainer_utilisation"] == pytest.approx(1.4 / 16.2)


def test_async_staleness_bound_wakes_idle_engine_when_the_step_ends():
    # staleness 0 -> bound (0 + 0 + 1) * 2 = 2 trajectories before step 1, 4 after it.
    # t=0    admit A=5, B=2 -> B done at t=4 (ready [2]). Nothing may start; A alone: 3 x 1.5 s -> t=8.5.
    # t=8.5  A done (ready [2, 5]), engine idle. Step 1: 7 tokens, 8.5 -> 9.7.
    # t=9.7  version 1: admit C=4, D=3 at once (no polling delay). D ends after 3 x 2 s -> t=15.7.
    # t=15.7 D done (ready [3]); C has 1 left, alone -> t=17.2, ready [3, 4]. Step 2: 17.2 -> 18.4.
    r = sim.simulate_async(cluster(staleness=0), COST, [5, 2, 4, 3])
    assert steps(r) == [(8.5, 9.7, 7), (17.2, 18.4, 7)]
    assert r["wall_s"] == pytest.approx(18.4)


def test_async_push_pause_lets_the_step_in_progress_finish():
    # pool A=5, B=2, C=6, D=3, pause 1 s when weights land.
    # t=0..10 as above with C=6: B done t=4, A done t=10 (ready [2, 5]); C has 3 left, D admitted (3 left):
    #        next end after 3 tokens at 2 s -> t=16. Step 1: 10 -> 11.2.
    # t=11.2 weights land mid-step (the step 10 -> 12 is under way): it completes at t=12 (C, D: 2 left each),
    #        then the engine pauses 1 s.
    # t=13   resume: 2 tokens x 2 s -> t=17, C and D done (ready [6, 3]). Step 2: 9 tokens, 17 -> 18.4.
    # Without the pause: C, D done at t=16, step 2 ends at 17.4.
    paused = sim.simulate_async(cluster(push_pause_seconds=1.0), COST, [5, 2, 6, 3])
    assert steps(paused) == [(10.0, 11.2, 7), (17.0, 18.4, 9)]
    # slot occupancy while decoding: [0, 12] 2/2 and [13, 17] 2/2 = 16 s; the pause [12, 13] is not busy
    assert paused["rollout_utilisation"] == pytest.approx(16 / 18.4)
    unpaused = sim.simulate_async(cluster(), COST, [5, 2, 6, 3])
    assert steps(unpaused) == [(10.0, 11.2, 7), (16.0, 17.4, 9)]


def test_async_pause_on_an_idle_engine_delays_admission():
    # staleness 0 (second case's schedule), pause 1 s: at t=9.7 the idle engine loads the weights until 10.7,
    # then admits C, D: D done at 16.7, C at 18.2; step 2: 18.2 -> 19.4.
    r = sim.simulate_async(cluster(staleness=0, push_pause_seconds=1.0), COST, [5, 2, 4, 3])
    assert steps(r) == [(8.5, 9.7, 7), (18.2, 19.4, 7)]


def test_sync_schedule():
    # iteration 1: [5, 2]: both decode 2 tokens (2 x 2 s = 4 s), then 5's last 3 alone (3 x 1.5 s) -> 8.5 s;
    #              train 0.7 + push 0.5 -> 9.7.
    # iteration 2: [4, 3]: 3 tokens together (6 s), then 1 alone (1.5 s) -> rollout ends 17.2; -> 18.4.
    # With a 1 s pause the second rollout starts after the weights land: everything after 9.7 moves by 1 s.
    r = sim.simulate_sync(cluster(), COST, [[5, 2], [4, 3]])
    assert steps(r) == [(8.5, 9.7, 7), (17.2, 18.4, 7)]
    # occupancy: 4 + 4.5/2 + 6 + 1.5/2 = 13 s
    assert r["rollout_utilisation"] == pytest.approx(13 / 18.4)
    paused = sim.simulate_sync(cluster(push_pause_seconds=1.0), COST, [[5, 2], [4, 3]])
    assert steps(paused) == [(8.5, 9.7, 7), (18.2, 19.4, 7)]


def test_async_pool_too_small_is_a_value_error():
    with pytest.raises(ValueError, match="pool"):
        sim.simulate_async(cluster(), COST, [5, 2, 4])


@pytest.mark.parametrize("content, message", [
    ("{", "cannot read"),
    ('{"dec_fixed": 1, "dec_per_seq": "x", "train_per_token": 1}', "'dec_per_seq'"),
    ('{"cost_model": {"dec_fixed": 1, "dec_per_seq": 1}}', "'train_per_token'"),
    ("[1]", "expected a JSON object"),
])
def test_bad_cost_file_names_the_flag(tmp_path, content, message):
    path = tmp_path / "cost.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--cost") as info:
        sim.load_cost(str(path))
    assert message in str(info.value)


def test_cost_from_an_earlier_result_file(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"command": "x", "cost_model": COST}))
    assert sim.load_cost(str(path)) == COST
