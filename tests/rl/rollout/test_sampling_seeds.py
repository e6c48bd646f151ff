"""Per-request sampling seeds (``sampling_params.sampling_seed``): a seeded request draws the same tokens whatever
the engine served before it (an unseeded one depends on the shared generator's history), the seed is parsed
as SGLang names it, and the runner's seeds are a pure function of (run seed, trajectory id, turn)."""
import pytest

from glm5_core.rl.rollout.sampling_seeds import sampling_seed
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest, Limits, parse_generate_request

LIMITS = Limits(vocab_size=100, max_input_tokens=10, max_new_tokens=5)


def _request(rid, seed=None, prompt=(5, 6, 7)):
    return GenerateRequest(rid, list(prompt), temperature=1.0, max_new_tokens=8, sampling_seed=seed)


def _served_after(tiny_policy, earlier, request):
    """``request``'s result from a fresh one-slot engine that first serves the ``earlier`` requests."""
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=64, seed=0, prefix_cache_entries=0)
    results = engine.generate(list(earlier) + [request])
    return results[-1].output_ids, results[-1].logprobs


def test_a_seeded_request_samples_the_same_whatever_came_before(tiny_policy):
    earlier = [_request(f"other{i}", prompt=(9, i + 1)) for i in range(3)]
    alone = _served_after(tiny_policy, [], _request("r", seed=1234))
    assert _served_after(tiny_policy, earlier, _request("r", seed=1234)) == alone
    assert _served_after(tiny_policy, [], _request("r", seed=1235)) != alone
    # without a seed the draws depend on what the shared generator drew before: what the seed removes
    assert _served_after(tiny_policy, earlier, _request("r")) != _served_after(tiny_policy, [], _request("r"))


def test_sampling_seed_is_parsed_as_sglang_names_it():
    body = {"input_ids": [1], "sampling_params": {"sampling_seed": 2 ** 63 - 1}}
    assert parse_generate_request(body, LIMITS).sampling_seed == 2 ** 63 - 1
    assert parse_generate_request({"input_ids": [1]}, LIMITS).sampling_seed is None
    for bad in (-1, 2 ** 63, True, 1.0, "7"):
        with pytest.raises(ValueError, match="sampling_params.sampling_seed"):
            parse_generate_request({"input_ids": [1], "sampling_params": {"sampling_seed": bad}}, LIMITS)


def test_runner_seeds_depend_on_run_seed_trajectory_and_turn_only():
    seeds = {sampling_seed(run, tid, turn) for run in (0, 1) for tid in ("g0-0", "g0-1", "g1-0") for turn in (0, 1)}
    assert len(seeds) == 12 and all(0 <= s < 2 ** 63 for s in seeds)
    assert sampling_seed(3, "g7-1", 2) == sampling_seed(3, "g7-1", 2)
