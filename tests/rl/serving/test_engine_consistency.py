"""At equal weights the trainer's recomputed log-probs equal the engine's recorded ones (fp32, 1e-5) and the
DSA top-k the trainer selects is the one the engine selected, token by token (100%)."""
import pytest
import torch

from glm5_core.rl.algorithm.trainer import pad_samples, sequence_logprobs
from glm5_core.rl.rollout.trajectory import Sample
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest


def make_requests(n, prompt_len, max_new, temperature=1.0, prefix=""):
    g = torch.Generator().manual_seed(prompt_len)
    return [GenerateRequest(f"{prefix}r{i}", torch.randint(0, 256, (prompt_len + 3 * i,), generator=g).tolist(),
                            temperature=temperature, top_p=0.95, max_new_tokens=max_new) for i in range(n)]


def recompute(model, requests, results, temperature):
    samples = []
    for req, res in zip(requests, results):
        s = Sample()
        s.append(req.input_ids, sampled=False)
        s.append(res.output_ids, sampled=True, logprobs=res.logprobs, versions=res.versions)
        samples.append(s)
    batch = pad_samples(samples)  # right-padded, as the trainer sees it
    with torch.no_grad():
        logp, topk = sequence_logprobs(model, batch["input_ids"], temperature)
    return batch, logp, topk


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_logprobs_and_topk_match_engine(tiny_policy, temperature):
    engine = RolloutEngine(tiny_policy, max_batch=3, max_len=128, record_topk=True, seed=1)
    requests = make_requests(5, prompt_len=13, max_new=12, temperature=temperature)  # 5 requests, 3 slots
    results = engine.generate(requests)
    # second turn of every trajectory: served from the prefix cache, then checked the same way
    turn2 = [GenerateRequest(r.rid, r.input_ids + res.output_ids + [32, 33, 34], temperature=temperature,
                             top_p=0.95, max_new_tokens=6) for r, res in zip(requests, results)]
    results2 = engine.generate(turn2)
    assert all(res.cached_tokens > 0 for res in results2)
    batch, logp, topk = recompute(tiny_policy, requests + turn2, results + results2, temperature)
    assert engine.stats.decode_slot_steps > engine.stats.decode_steps  # several slots decoded together
    assert len(topk) >= 2 and topk[0].shape[-1] == 8
    worst = 0.0
    compared = 0
    for row, (req, res) in enumerate(zip(requests + turn2, results + results2)):
        P = len(req.input_ids)
        got = logp[row, P - 1:P - 1 + len(res.output_ids)]
        worst = max(worst, (got - torch.tensor(res.logprobs)).abs().max().item())
        for j in range(len(res.output_ids)):
            for layer, idx in enumerate(topk):
                assert idx[row, P - 1 + j].tolist() == res.topk_trace[j][layer], (row, j, layer)
                compared += 1
        assert torch.equal(batch["rollout_logprobs"][row, P - 1:P - 1 + len(res.output_ids)],
                           torch.tensor(res.logprobs))
    assert worst <= 1e-5
    assert compared > 100
    # the sequences are longer than k: the selection is really sparse somewhere
    assert any((idx[row] >= 0).sum(-1).max() == 8 and len(r.input_ids) > 8
               for idx in topk for row, r in enumerate(requests))


def test_prefix_cache_prefills_only_new_tokens_and_weight_update_flushes(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=128, seed=0)
    (req,) = make_requests(1, prompt_len=20, max_new=5, prefix="p")
    (res,) = engine.generate([req])
    assert engine.stats.prefill_tokens == 20
    follow = GenerateRequest(req.rid, req.input_ids + res.output_ids + [40, 41], max_new_tokens=3)
    (res2,) = engine.generate([follow])
    # everything but the last sampled token (no KV yet) and the two new tokens was cached
    assert res2.cached_tokens == 20 + len(res.output_ids) - 1
    assert engine.stats.prefill_tokens == 20 + 3
    engine.update_weights({k: v.clone() for k, v in tiny_policy.state_dict().items()}, version=4)
    (res3,) = engine.generate([GenerateRequest(req.rid, follow.input_ids + res2.output_ids, max_new_tokens=2)])
    assert res3.cached_tokens == 0 and res3.versions == [4] * len(res3.output_ids)


def test_greedy_output_is_independent_of_batch_company(tiny_policy):
    requests = make_requests(4, prompt_len=9, max_new=10, temperature=0.0, prefix="g")
    alone = [RolloutEngine(tiny_policy, max_batch=1, max_len=128).generate([r])[0].output_ids for r in requests]
    together = [res.output_ids for res in RolloutEngine(tiny_policy, max_batch=4, max_len=128).generate(requests)]
    assert alone == together


def test_engine_rejects_bad_configuration(tiny_policy):
    with pytest.raises(ValueError, match="max_batch"):
        RolloutEngine(tiny_policy, max_batch=0)
    with pytest.raises(ValueError, match="max_len"):
        RolloutEngine(tiny_policy, max_len=10**6)
    engine = RolloutEngine(tiny_policy, max_len=16)
    with pytest.raises(ValueError, match="input_ids"):
        engine.submit(GenerateRequest("x", list(range(20))))


def test_kv_computed_before_a_mid_generation_weight_update_is_not_reused(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=128, seed=0)
    (req,) = make_requests(1, prompt_len=15, max_new=6, prefix="s")
    engine.submit(req)
    engine.step()  # prefill + one decode under version 0
    engine.update_weights({k: v.clone() for k, v in tiny_policy.state_dict().items()}, version=1)
    engine.run_until_idle()  # the rest of the answer decodes under version 1 on top of version-0 KV
    assert len(engine.prefix_cache) == 0  # the finished slot mixed versions 0 and 1: nothing stored
    first = engine.stats.prefill_tokens
    follow = GenerateRequest(req.rid, req.input_ids + [7] * 4 + [40, 41], max_new_tokens=2)
    (res,) = engine.generate([follow])
    assert res.cached_tokens == 0
    assert engine.stats.prefill_tokens - first == len(follow.input_ids)  # full prefill under version 1
    # a turn that ran entirely under version 1 is cached again
    (res2,) = engine.generate([GenerateRequest(req.rid, follow.input_ids + res.output_ids + [42], max_new_tokens=1)])
    assert res2.cached_tokens == len(follow.input_ids) + len(res.output_ids) - 1


def test_prefix_cache_lookup_ignores_entries_older_than_min_version():
    from glm5_core.rl.serving.prefix_cache import TrajectoryPrefixCache

    cache = TrajectoryPrefixCache(4)
    cache.store("t", [1, 2, 3, 4], [torch.zeros(1, 4, 2)], version=2)
    assert cache.lookup("t", [1, 2, 3, 9], min_version=2)[0] == 3
    assert cache.lookup("t", [1, 2, 3, 9], min_version=3) == (0, None)
    assert len(cache) == 0  # the stale entry is gone
