import math

import pytest
import torch

from glm5_core.rl.serving.sampling import sample, token_logprobs, top_p_filter


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
