"""MTP speculative decoding in the rollout engine: exact greedy parity, target-distribution sampling (chi-square),
the trainer's recomputed log-probs and DSA top-k, per-row acceptance, and the setting's refusals."""
import itertools

import pytest
import torch

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.rl.algorithm.trainer import pad_samples, sequence_logprobs
from glm5_core.rl.rollout.trajectory import Sample
from glm5_core.rl.serving import kv_slots
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest
from glm5_core.rl.serving.speculative_sampling import accept_drafts, draw, sampling_probs

ALPHA = 1e-4  # chi-square tests: a correct sampler fails a given seed with this probability


def chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's goodness-of-fit test. Cells expected below 5 are pooled into one cell (the chi-square
    approximation of the multinomial needs about 5 per cell); under H0 the statistic is chi-square with
    cells - 1 degrees of freedom, whose tail is the regularised upper incomplete gamma Q(dof / 2, x / 2)."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    small = expected < 5
    if small.any():
        counts = torch.cat((counts[~small], counts[small].sum().view(1)))
        expected = torch.cat((expected[~small], expected[small].sum().view(1)))
    assert (expected > 0).all() and len(expected) >= 3, "too few cells for a meaningful test"
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def peaked_model(vocab_size: int, seed: int = 0, logit_scale: float = 8.0) -> GLM5ForCausalLM:
    """A random tiny model over a small vocabulary whose next-token distributions are far from uniform (so
    drafts are both accepted and rejected) and whose MTP layer disagrees with it often enough."""
    torch.manual_seed(seed)
    model = GLM5ForCausalLM(GLM5Config.tiny(vocab_size=vocab_size, index_topk=8, max_position_embeddings=96)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


# ---- the rejection rule on its own --------------------------------------------------------------------
def test_accept_drafts_emits_target_distribution_per_position():
    """Synthetic p, q over 5 tokens, d = 2, 200k rows in one call: the first emitted token follows p_0, and the
    second (emitted when the first draft was accepted) follows p_1."""
    g = torch.Generator().manual_seed(0)
    B, d, V = 200_000, 2, 5
    p = torch.softmax(torch.randn(d + 1, V, generator=g) * 1.5, -1)  # [d+1, V]
    q = torch.softmax(torch.randn(d, V, generator=g) * 1.5, -1)  # [d, V]
    drafts = torch.stack([torch.multinomial(q[j], B, replacement=True, generator=g) for j in range(d)], 1)  # [B, d]
    tokens, accepted = accept_drafts(p.expand(B, d + 1, V), drafts, q.expand(B, d, V), g)
    assert 0.05 < (accepted == 0).float().mean() < 0.95 and (accepted == d).any()  # both branches ran
    first = torch.bincount(tokens[:, 0], minlength=V)
    assert chi_square_pvalue(first, B * p[0]) > ALPHA
    second_rows = accepted >= 1
    second = torch.bincount(tokens[second_rows, 1], minlength=V)
    assert chi_square_pvalue(second, second_rows.sum() * p[1]) > ALPHA
    bonus_rows = accepted == d
    bonus = torch.bincount(tokens[bonus_rows, d], minlength=V)
    assert chi_square_pvalue(bonus, bonus_rows.sum() * p[d]) > ALPHA


def test_accept_drafts_limit_tests_only_the_first_drafts_and_draws_the_bonus_there():
    """limit 1 at d = 2: the second draft is never tested; a row that accepts the first draft emits a token drawn
    from p_1 (the bonus of a one-draft row), not the outcome of testing draft 2."""
    g = torch.Generator().manual_seed(1)
    B, d, V = 200_000, 2, 5
    p = torch.softmax(torch.randn(d + 1, V, generator=g) * 1.5, -1)  # [d+1, V]
    q = torch.softmax(torch.randn(d, V, generator=g) * 1.5, -1)  # [d, V]
    drafts = torch.stack([torch.multinomial(q[j], B, replacement=True, generator=g) for j in range(d)], 1)
    limit = torch.ones(B, dtype=torch.long)
    tokens, accepted = accept_drafts(p.expand(B, d + 1, V), drafts, q.expand(B, d, V), g, limit=limit)
    assert accepted.max() == 1 and (accepted == 1).any() and (accepted == 0).any()
    assert chi_square_pvalue(torch.bincount(tokens[:, 0], minlength=V), B * p[0]) > ALPHA
    rows = accepted == 1
    assert chi_square_pvalue(torch.bincount(tokens[rows, 1], minlength=V), rows.sum() * p[1]) > ALPHA


def test_draw_inverts_the_cumulative_distribution_and_never_picks_a_zero_weight():
    g = torch.Generator().manual_seed(2)
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 5.0, 0.0])  # unnormalised, zero weights inside and at the end
    N = 100_000
    tokens = draw(weights.expand(N, -1), torch.rand(N, generator=g))
    counts, positive = torch.bincount(tokens, minlength=6), weights > 0
    assert (counts[~positive] == 0).all()
    assert chi_square_pvalue(counts[positive], N * weights[positive] / weights.sum()) > ALPHA
    # the smallest and largest uniforms torch.rand gives, and 1.0: a product with the total rounded up to it
    edge = torch.tensor([0.0, 1.0 - 2.0 ** -24, 1.0])
    assert draw(weights.expand(3, -1), edge).tolist() == [1, 4, 4]


def test_accept_drafts_greedy_rows_keep_the_target_argmax():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]] * 2)  # [2, 3, 3]
    temperature, top_p = torch.zeros(2), torch.ones(2)
    p = sampling_probs(logits, temperature, top_p)
    drafts = torch.tensor([[1, 0], [1, 2]])  # row 0: both are the argmax; row 1: the second is not
    q = sampling_probs(torch.nn.functional.one_hot(drafts, 3).float(), temperature, top_p)
    tokens, accepted = accept_drafts(p, drafts, q, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2, 1]
    assert tokens[0].tolist() == [1, 0, 2] and tokens[1, :2].tolist() == [1, 0]


# ---- the engine ---------------------------------------------------------------------------------------
def ragged_requests(n, vocab, temperature, top_p=1.0, max_new=24, prefix="r"):
    g = torch.Generator().manual_seed(5)
    return [GenerateRequest(f"{prefix}{i}", torch.randint(0, vocab, (11 + 4 * i,), generator=g).tolist(),
                            temperature=temperature, top_p=top_p, max_new_tokens=max_new - 3 * (i % 2))
            for i in range(n)]


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_greedy_speculative_equals_plain_greedy_bitwise(draft_tokens, monkeypatch):
    """Five ragged requests over 3 slots (rows accept different counts in one step, their caches roll back
    separately); sequences run past index_topk, so DSA really selects."""
    from glm5_core.rl.serving import speculative

    counts = []  # per verify step: accepted drafts of the active slots

    def recording(*args, **kwargs):
        tokens, accepted = accept_drafts(*args, **kwargs)
        active = [i for i, s in enumerate(engine._slots) if s is not None]  # the step's window starts at active[0]
        counts.append([accepted[i - active[0]].item() for i in active])
        return tokens, accepted

    monkeypatch.setattr(speculative, "accept_drafts", recording)
    model = peaked_model(vocab_size=6)
    plain = RolloutEngine(model, max_batch=3, max_len=96, record_topk=True).generate(ragged_requests(5, 6, 0.0))
    engine = RolloutEngine(model, max_batch=3, max_len=96, record_topk=True,
                           speculative={"draft_tokens": draft_tokens})
    spec = engine.generate(ragged_requests(5, 6, 0.0))
    stats = engine.speculative.stats
    assert 0 < stats.accepted < stats.drafted  # drafts were accepted and rejected
    assert sum(len(set(step)) > 1 for step in counts) >= 3  # rows of one step accepted different counts
    for a, b in zip(plain, spec):
        assert b.output_ids == a.output_ids
        assert b.finish_reason == a.finish_reason
        assert b.topk_trace == a.topk_trace  # the verify forward selected the keys plain decoding selects
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_tokens_follow_the_target_distribution(seeded):
    """4000 requests for 3 tokens of one prompt, vocabulary 4, d = 2, temperature 0.8, top-p 0.9: the joint
    distribution of (x1, x2, x3) (x2 and x3 come from accepted drafts, residual or bonus draws) against the exact
    one, computed from the model's full forwards (what plain sampling draws from); ``seeded``: every request draws
    from its own sampling_seed's generator."""
    V, N, temperature, top_p = 4, 4000, 0.8, 0.9
    model = peaked_model(vocab_size=V, seed=1)
    prompt = [1, 2, 3, 0, 1, 2, 0, 0, 3, 1, 2]
    with torch.no_grad():  # p(x_t | prompt, x_<t) for every prefix of length 0, 1, 2
        cond = []
        for length in range(3):
            prefixes = list(itertools.product(range(V), repeat=length))
            ids = torch.tensor([prompt + list(pre) for pre in prefixes])
            logits = model(ids).logits[:, -1:]  # [V^length, 1, V]
            raw = torch.softmax(logits[:, 0] / temperature, -1)
            probs = sampling_probs(logits, torch.full((len(prefixes),), temperature),
                                   torch.full((len(prefixes),), top_p))[:, 0]
            cond.append(probs.double().view(*([V] * length), V))
            if length == 2:
                assert ((raw > 1e-3) & (probs == 0)).any()  # top-p removes some likely-enough tokens
    joint = cond[0].view(V, 1, 1) * cond[1].view(V, V, 1) * cond[2]  # [V, V, V]
    engine = RolloutEngine(model, max_batch=64, max_len=32, prefix_cache_entries=0, seed=3,
                           speculative={"draft_tokens": 2})
    results = engine.generate([GenerateRequest(f"s{i}", prompt, temperature=temperature, top_p=top_p,
                                               max_new_tokens=4, sampling_seed=1000 + i if seeded else None)
                               for i in range(N)])
    stats = engine.speculative.stats
    assert 0.1 * stats.drafted < stats.accepted < 0.9 * stats.drafted
    cells = torch.tensor([r.output_ids[0] * V * V + r.output_ids[1] * V + r.output_ids[2] for r in results])
    counts = torch.bincount(cells, minlength=V ** 3)
    assert chi_square_pvalue(counts, N * joint.flatten()) > ALPHA


def test_a_seeded_request_draws_the_same_tokens_whatever_came_before_or_beside_it():
    """sampling_seed under speculative decoding: drafts, acceptance tests and corrected / bonus tokens all come from
    the request's own generator, so its tokens do not depend on the engine's seed, on what the engine served before
    or on the (unseeded) requests decoded in the same steps; another seed draws other tokens."""
    model = peaked_model(vocab_size=6)
    prompt = ragged_requests(1, 6, 1.0)[0].input_ids

    def seeded(rid, seed):
        return GenerateRequest(rid, prompt, temperature=1.0, max_new_tokens=24, sampling_seed=seed)

    def engine(seed, max_batch=1):
        return RolloutEngine(model, max_batch=max_batch, max_len=96, seed=seed, prefix_cache_entries=0,
                             speculative={"draft_tokens": 3})

    spec = engine(0)
    alone = spec.generate([seeded("a", 7)])[0].output_ids
    assert 0 < spec.speculative.stats.accepted < spec.speculative.stats.drafted  # drafts accepted and rejected
    after = engine(1).generate(ragged_requests(2, 6, 1.0) + [seeded("b", 7)])[-1].output_ids
    beside = engine(2, max_batch=3).generate(ragged_requests(2, 6, 1.0, prefix="c") + [seeded("c", 7)])[-1]
    assert after == alone and beside.output_ids == alone
    assert engine(0).generate([seeded("d", 8)])[0].output_ids != alone


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_and_topk_match_trainer_recompute(tiny_policy, temperature):
    """As for plain decoding (test_engine_consistency): the trainer's recomputed log-probs equal the recorded ones
    (1e-5) and its DSA top-k is the engine's, token by token, for a first turn and a prefix-cached second one."""
    engine = RolloutEngine(tiny_policy, max_batch=3, max_len=128, record_topk=True, seed=1,
                           speculative={"draft_tokens": 3})
    requests = ragged_requests(5, 256, temperature, top_p=0.95, max_new=14)
    results = engine.generate(requests)
    turn2 = [GenerateRequest(r.rid, r.input_ids + res.output_ids + [32, 33], temperature=temperature, top_p=0.95,
                             max_new_tokens=6) for r, res in zip(requests, results)]
    results2 = engine.generate(turn2)
    assert all(res.cached_tokens > 0 for res in results2)
    samples = []
    for req, res in zip(requests + turn2, results + results2):
        s = Sample()
        s.append(req.input_ids, sampled=False)
        s.append(res.output_ids, sampled=True, logprobs=res.logprobs, versions=res.versions)
        samples.append(s)
    batch = pad_samples(samples)
    with torch.no_grad():
        logp, topk = sequence_logprobs(tiny_policy, batch["input_ids"], temperature)
    compared = 0
    for row, (req, res) in enumerate(zip(requests + turn2, results + results2)):
        P, n = len(req.input_ids), len(res.output_ids)
        assert n == req.max_new_tokens
        assert (logp[row, P - 1:P - 1 + n] - torch.tensor(res.logprobs)).abs().max() <= 1e-5
        for j in range(n):
            for layer, idx in enumerate(topk):
                assert idx[row, P - 1 + j].tolist() == res.topk_trace[j][layer], (row, j, layer)
                compared += 1
    assert compared > 100


def test_stop_token_inside_accepted_drafts_ends_the_request_there():
    model = peaked_model(vocab_size=6)
    requests = ragged_requests(3, 6, 0.0, max_new=30)
    plain = RolloutEngine(model, max_batch=3, max_len=96).generate(requests)
    stop = plain[0].output_ids[5]  # a token the greedy continuation reaches
    stopping = [GenerateRequest(r.rid, r.input_ids, temperature=0.0, max_new_tokens=30, stop_token_ids=[stop])
                for r in requests]
    want = RolloutEngine(model, max_batch=3, max_len=96).generate(stopping)
    got = RolloutEngine(model, max_batch=3, max_len=96, speculative={"draft_tokens": 4}).generate(stopping)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert got[0].output_ids[-1] == stop and got[0].finish_reason == "stop"


def test_requests_done_at_their_first_token_one_token_prompts_and_a_mixed_batch():
    model = peaked_model(vocab_size=6)
    requests = [GenerateRequest(f"one{i}", [1, 2, 3, i], temperature=0.0, max_new_tokens=1) for i in range(2)]
    requests += [GenerateRequest("long", [4, 5, 1], temperature=0.0, max_new_tokens=9),
                 GenerateRequest("single", [3], temperature=0.0, max_new_tokens=7)]
    want = RolloutEngine(model, max_batch=3, max_len=40).generate(requests)  # 4 requests, 3 slots
    engine = RolloutEngine(model, max_batch=3, max_len=40, speculative={"draft_tokens": 3})
    assert [r.output_ids for r in engine.generate(requests[:2])] == [r.output_ids for r in want[:2]]
    assert [r.output_ids for r in engine.generate(requests)] == [r.output_ids for r in want]


def test_rows_reaching_max_len_stop_at_the_cache_end():
    model = peaked_model(vocab_size=6)
    requests = [GenerateRequest("a", [1, 2, 3] * 9, temperature=0.0, max_new_tokens=40),
                GenerateRequest("b", [4, 5], temperature=0.0, max_new_tokens=40)]
    want = RolloutEngine(model, max_batch=2, max_len=40).generate(requests)
    got = RolloutEngine(model, max_batch=2, max_len=40, speculative={"draft_tokens": 4}).generate(requests)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert len(requests[0].input_ids) + len(got[0].output_ids) == 40 and got[0].finish_reason == "length"


def test_speculative_setting_is_refused_without_mtp_weights_or_with_bad_values():
    no_mtp = GLM5ForCausalLM(GLM5Config.tiny(num_nextn_predict_layers=0, max_position_embeddings=64))
    with pytest.raises(ValueError, match="speculative: expected a model with MTP weights"):
        RolloutEngine(no_mtp, max_len=64, speculative={"draft_tokens": 2})
    model = peaked_model(vocab_size=6)
    for bad in ({"draft_tokens": 0}, {"draft_tokens": True}, {"draft_tokens": 2, "x": 1}, {}, 3):
        with pytest.raises(ValueError, match="speculative"):
            RolloutEngine(model, max_len=64, speculative=bad)
    assert RolloutEngine(model, max_len=64).speculative is None  # off by default


# ---- the run config (rollout.speculative) --------------------------------------------------------------
@pytest.mark.parametrize("data, expected", [
    ({"rollout": {"speculative": {"draft_tokens": 0}}}, "rollout.speculative.draft_tokens: expected an int in [1, 16]"),
    ({"rollout": {"speculative": {"tokens": 2}}}, "rollout.speculative: expected null or {draft_tokens: d}"),
    ({"rollout": {"speculative": {"draft_tokens": 2}},
      "model": {"preset": "tiny", "overrides": {"num_nextn_predict_layers": 0}}},
     "rollout.speculative: expected a model with MTP weights"),
])
def test_run_config_refuses_bad_speculative_settings_in_one_line(monkeypatch, data, expected):
    from glm5_core.rl.config_loader import config_from_dict

    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    with pytest.raises(ValueError) as info:
        config_from_dict(data)
    problems = getattr(info.value, "problems", [str(info.value)])
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_run_config_passes_speculative_to_the_engine_workers(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    from glm5_core.rl.config_loader import config_from_dict
    from glm5_core.rl.serving.worker import WorkerSpec, build_server

    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    assert config_from_dict({}).rollout.speculative is None
    cfg = config_from_dict({"rollout": {"speculative": {"draft_tokens": 3}}})
    assert cfg.rollout.speculative == {"draft_tokens": 3}
    model = peaked_model(vocab_size=6)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    spec = WorkerSpec(model.config.to_hf_dict(), str(tmp_path / "w.safetensors"), 0, str(tmp_path), max_len=64,
                      speculative=cfg.rollout.speculative)
    assert build_server(spec).engine.speculative.draft_tokens == 3


def test_a_later_turn_reuses_the_mtp_rows_of_its_prefix():
    """The prefix cache keeps the MTP layer's rows with the main ones: after a cached second turn's prefill the
    MTP cache over the reused prefix holds what a full prefill of that context computes."""
    model = peaked_model(vocab_size=6)
    (first,) = ragged_requests(1, 6, 0.0, max_new=12)
    cached = RolloutEngine(model, max_batch=1, max_len=96, speculative={"draft_tokens": 2})
    (res,) = cached.generate([first])
    verified = cached.speculative.mtp_len[0]  # MTP positions computed from the main model's hidden states
    turn2 = GenerateRequest(first.rid, first.input_ids + res.output_ids + [1, 2], temperature=0.0, max_new_tokens=4)
    fresh = RolloutEngine(model, max_batch=1, max_len=96, prefix_cache_entries=0, speculative={"draft_tokens": 2})
    for engine in (cached, fresh):
        engine.submit(turn2)
        engine.step()  # prefill + one speculative step
    assert cached.stats.cached_tokens > verified > len(first.input_ids)
    for got, want in zip(kv_slots.tensors(cached.speculative.cache), kv_slots.tensors(fresh.speculative.cache)):
        assert torch.allclose(got[0, :verified], want[0, :verified], atol=1e-5, rtol=0)


def test_glm5_serve_refuses_speculative_decoding_in_one_line(tmp_path, capsys):
    from glm5_core.cli import main
    from glm5_core.model.checkpoint import save_pretrained

    no_mtp = GLM5ForCausalLM(GLM5Config.tiny(num_nextn_predict_layers=0, max_position_embeddings=64))
    save_pretrained(no_mtp, tmp_path / "no_mtp")
    argv = ["serve", "--checkpoint", str(tmp_path / "no_mtp"), "--port", "0", "--backend", "cpu"]
    assert main(argv + ["--speculative-draft-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speculative: expected a model with MTP weights" in err[0], err
    assert main(argv + ["--speculative-draft-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--speculative-draft-tokens: expected an int in [1, 16], got 0" in err[0], err


def test_glm5_rl_refuses_speculative_decoding_for_a_checkpoint_without_mtp_shards(tmp_path, monkeypatch):
    """transformers writes no MTP weights though its config.json declares them: refused before any engine starts."""
    import json

    from glm5_core.model.checkpoint import save_pretrained
    from glm5_core.rl.config_loader import config_from_dict
    from glm5_core.rl.driver import RLRun

    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    save_pretrained(GLM5ForCausalLM(GLM5Config.tiny(num_nextn_predict_layers=0)), tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    cfg = config_from_dict({"rollout": {"speculative": {"draft_tokens": 2}}, "output_dir": str(tmp_path / "run")})
    with pytest.raises(ValueError, match="rollout.speculative: expected a model with MTP weights .*shards hold no"):
        RLRun(cfg, checkpoint=str(tmp_path / "ckpt"), backend="cpu", log=lambda _: None)


def test_server_info_reports_the_acceptance_length_as_sglang_does():
    import json
    import urllib.request

    from glm5_core.rl.serving.server import EngineServer

    model = peaked_model(vocab_size=6)
    engine = RolloutEngine(model, max_batch=2, max_len=64, speculative={"draft_tokens": 2})
    engine.generate(ragged_requests(2, 6, 0.0, max_new=10))
    servers = [EngineServer(engine).start(), EngineServer(RolloutEngine(model, max_batch=2, max_len=64)).start()]
    try:
        spec_info, plain_info = [json.loads(urllib.request.urlopen(f"{s.url}/get_server_info", timeout=30).read())
                                 for s in servers]
        assert spec_info["internal_states"][0]["avg_spec_accept_length"] == \
            engine.speculative.stats.mean_acceptance_length() > 1.0
        assert "avg_spec_accept_length" not in plain_info["internal_states"][0]
    finally:
        for server in servers:
            server.shutdown()
