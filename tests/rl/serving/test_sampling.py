import math

import pytest
import torch

from glm5_core.rl.serving.sampling import GREEDY_BELOW, sample, sorted_top_p_filter, token_logprobs, top_p_filter


def brute_force_top_p(probs, p):
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    keep, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        keep.add(i)
        mass += probs[i]
    return keep


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_matches_brute_force(seed, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 11, generator=g, dtype=torch.float64)
    logits[1, 3] = logits[1, 7]  # a tie
    out = top_p_filter(logits, torch.full((3,), top_p, dtype=torch.float64))
    probs = torch.softmax(logits, -1)
    for b in range(3):
        kept = {i for i in range(11) if math.isfinite(out[b, i].item())}
        assert kept == brute_force_top_p(probs[b].tolist(), top_p)


def test_sampled_logprob_is_temperature_scaled_full_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, generator=g)
    temp = torch.tensor([0.5, 1.0, 2.0, 0.7])
    tokens, logp = sample(logits, temp, torch.tensor([1.0, 0.8, 0.5, 0.3]), g)
    for b in range(4):
        expected = torch.log_softmax(logits[b] / temp[b], -1)[tokens[b]]
        assert logp[b].item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(token_logprobs(logits, tokens, 2.0),
                          torch.log_softmax(logits / 2, -1).gather(1, tokens[:, None])[:, 0])


def test_greedy_takes_lowest_id_among_maxima_and_top_p_bounds_support():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    tokens, _ = sample(logits, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.5]))
    assert tokens[0].item() == 1
    assert tokens[1].item() == 0  # top_p 0.5 leaves only the dominant token


def test_sampling_frequencies_follow_the_distribution():
    g = torch.Generator().manual_seed(3)
    logits = torch.log(torch.tensor([0.1, 0.2, 0.7])).repeat(4000, 1)
    tokens, _ = sample(logits, torch.ones(4000), torch.ones(4000), g)
    freq = torch.bincount(tokens, minlength=3).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64), atol=0.03)


def test_top_p_one_keeps_the_whole_vocabulary_of_a_large_model():
    # Over 32K tokens the fp32 running sum of the sorted probabilities reaches 1.0 before the tail: top_p = 1
    # (no nucleus) must still keep every token, as the recorded full-softmax log-prob assumes.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 32768, generator=g) * 3
    out = top_p_filter(logits, torch.tensor([1.0, 0.5]))
    assert not torch.isinf(out[0]).any()
    probs = torch.softmax(logits[1].double(), -1)
    kept = ~torch.isinf(out[1])
    # the row with top_p = 0.5 is still a nucleus: it reaches 0.5 and removing its least likely member does not
    assert probs[kept].sum() >= 0.5 - 1e-6 and probs[kept].sum() - probs[kept].min() < 0.5 + 1e-6


def full_sort_sample(logits_BV, temperature_B, top_p_B, generator=None):
    """The sampler before its fast paths (full-vocabulary softmax, full stable sort, multinomial for every row,
    greedy rows included): the spec the fast sampler must reproduce draw for draw."""
    logits = logits_BV.float()
    greedy = temperature_B < GREEDY_BELOW
    temp = torch.where(greedy, torch.ones_like(temperature_B), temperature_B).float()
    scaled = logits / temp.unsqueeze(-1)
    logp_full = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(sorted_top_p_filter(scaled, top_p_B.float()), dim=-1)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), drawn)
    return tokens, logp_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _logits_with_ties(seed, B, V, scale, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * scale).to(dtype)
    if seed % 2:
        logits = logits.round()  # many exact ties, at the nucleus cut too
    return logits


@pytest.mark.parametrize("V", [5, 300, 4096, 40000])
@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])  # flat (a nucleus wider than the first partial sort) to peaked
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_partial_sort_top_p_keeps_the_full_sort_set(V, scale, dtype):
    for seed in range(4):
        logits = _logits_with_ties(seed, 6, V, scale, dtype)
        top_p = torch.tensor([1.0, 0.999, 0.9, 0.5, 0.1, 1e-4], dtype=dtype)
        assert torch.equal(top_p_filter(logits, top_p), sorted_top_p_filter(logits, top_p))


def test_top_p_ties_at_the_cut_keep_the_lowest_ids():
    logits = torch.log(torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25]]))
    out = top_p_filter(logits, torch.tensor([0.5, 0.3]))
    assert torch.isfinite(out).tolist() == [[False, True, True, False], [True, True, False, False]]


@pytest.mark.parametrize("seed", range(6))
def test_fast_sampler_draws_what_the_full_sort_sampler_draws(seed):
    """Same seeded generator, same logits: identical tokens and log-probs (bitwise), for batches mixing greedy
    rows, top_p = 1 rows and nucleus rows, and for the generator state left behind."""
    logits = _logits_with_ties(seed, 8, 1000, 3.0, torch.float32)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0, 0.5, 2.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.3, 0.95, 1.0, 0.7])
    if seed >= 3:
        top_p = torch.ones(8)  # no nucleus anywhere: the filter is skipped
    g_fast, g_spec = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for _ in range(5):
        fast, spec = sample(logits, temperature, top_p, g_fast), full_sort_sample(logits, temperature, top_p, g_spec)
        assert torch.equal(fast[0], spec[0]) and torch.equal(fast[1], spec[1])
    assert torch.equal(g_fast.get_state(), g_spec.get_state())


def test_all_greedy_batch_is_an_argmax_that_consumes_no_randomness():
    logits = _logits_with_ties(1, 4, 500, 3.0, torch.float32)  # rounded: ties for the maximum
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    tokens, logp = sample(logits, torch.zeros(4), torch.tensor([1.0, 0.5, 0.9, 1.0]), g)
    spec_tokens, spec_logp = full_sort_sample(logits, torch.zeros(4), torch.tensor([1.0, 0.5, 0.9, 1.0]))
    assert torch.equal(tokens, spec_tokens) and torch.equal(logp, spec_logp)
    assert torch.equal(g.get_state(), state)
