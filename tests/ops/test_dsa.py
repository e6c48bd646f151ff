"""The DSA reference: indexer scores, the top-k contract, and sparse attention."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import dsa, mla


def brute_force_scores(q, k, w, positions):
    B, T, H, _ = q.shape
    S = k.shape[1]
    out = torch.full((B, T, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for s in range(min(positions[b][t] + 1, S)):
                out[b, t, s] = sum(float(w[b, t, h]) * max(float(q[b, t, h].double() @ k[b, s].double()), 0.0)
                                   for h in range(H))
    return out


def contract_topk(scores, K):
    """The contract written as a Python sort: score descending, then key index ascending; -1 padding."""
    B, T, S = scores.shape
    out = torch.full((B, T, K), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            visible = [s for s in range(S) if scores[b, t, s] != float("-inf")]
            ranked = sorted(visible, key=lambda s: (-float(scores[b, t, s]), s))[:K]
            out[b, t, :len(ranked)] = torch.tensor(ranked, dtype=torch.int32)
    return out


def positions_of(start, B, T):
    if isinstance(start, torch.Tensor):
        return [[int(start[b]) + t for t in range(T)] for b in range(B)]
    return [[start + t for t in range(T)] for _ in range(B)]


@pytest.mark.parametrize("shape", testing.INDEXER_SHAPES, ids=str)
def test_scores_match_brute_force(shape):
    x = testing.make_indexer_inputs(shape, dtype=torch.float64, seed=2)
    start = shape.S - shape.T
    got = dsa.indexer_scores(x["q"], x["k"], x["w"], start_pos=start)
    want = brute_force_scores(x["q"], x["k"], x["w"], positions_of(start, shape.B, shape.T))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("shape", testing.INDEXER_SHAPES, ids=str)
@pytest.mark.parametrize("ties", ["zero_relu", "duplicate_keys", "bf16_quantised", "integer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_follows_the_tie_contract_exactly(shape, ties, dtype):
    x = testing.make_indexer_inputs(shape, dtype=dtype, seed=5, ties=ties)
    start = torch.tensor([max(0, shape.S - shape.T - 2 * b) for b in range(shape.B)])
    got = dsa.indexer_topk(x["q"], x["k"], x["w"], shape.K, start_pos=start)
    scores = brute_force_scores(x["q"], x["k"], x["w"], positions_of(start, shape.B, shape.T))
    assert got.dtype == torch.int32
    assert torch.equal(got, contract_topk(scores, shape.K))


def test_all_zero_scores_select_the_lowest_indices_then_pad():
    shape = testing.IndexerShape(B=1, T=4, S=6, H=2, D=8, K=3)
    x = testing.make_indexer_inputs(shape, seed=1, ties="zero_relu")
    got = dsa.indexer_topk(x["q"], x["k"], x["w"], 3, start_pos=0)
    assert got[0].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2]]


def test_k_larger_than_the_cache_pads_with_minus_one():
    shape = testing.IndexerShape(B=2, T=2, S=3, H=1, D=4, K=8)
    x = testing.make_indexer_inputs(shape, seed=0)
    got = dsa.indexer_topk(x["q"], x["k"], x["w"], 8, start_pos=1)
    assert got.shape == (2, 2, 8)
    assert (got[:, 0, 2:] == -1).all() and (got[:, 1, 3:] == -1).all()
    assert (got[:, 0, :2] >= 0).all() and (got[:, 1, :3] >= 0).all()


def test_sparse_attention_over_every_visible_key_is_dense_attention():
    shape = testing.MLAShape(B=2, T=4, S=9, H=3, Dn=6, Dr=4, Dv=5, C=12)
    x = testing.make_mla_inputs(shape, dtype=torch.float64, seed=4)
    start = shape.S - shape.T
    idx = torch.full((shape.B, shape.T, shape.S + 2), -1, dtype=torch.int32)
    for t in range(shape.T):
        visible = start + t + 1
        idx[:, t, :visible] = torch.randperm(visible, generator=testing.generator(t)).to(torch.int32)  # any order
    dense = mla.decode(**x, scale=0.4, start_pos=start)
    for entry in (dsa.sparse_prefill, dsa.sparse_decode):
        assert torch.allclose(entry(**x, topk_idx=idx, scale=0.4), dense, atol=1e-12, rtol=0)


def test_sparse_attention_uses_only_the_selected_keys_and_zero_for_none():
    shape = testing.MLAShape(B=1, T=2, S=7, H=2, Dn=4, Dr=2, Dv=3, C=8)
    x = testing.make_sparse_inputs(shape, 3, dtype=torch.float64, seed=8)
    out = dsa.sparse_decode(**x, scale=0.5)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))  # the maker leaves row (0, 0) with no key
    selected = set(x["topk_idx"][0, 1].tolist()) - {-1}
    unselected = [s for s in range(shape.S) if s not in selected]
    x["c_kv"][0, unselected] = 1e3
    x["k_pe"][0, unselected] = 1e3
    assert torch.equal(dsa.sparse_decode(**x, scale=0.5)[0, 1], out[0, 1])


def test_sparse_prefill_is_differentiable():
    shape = testing.MLAShape(B=1, T=3, S=5, H=2, Dn=3, Dr=2, Dv=3, C=4)
    x = testing.make_sparse_inputs(shape, 2, dtype=torch.float64, seed=1)
    idx = x.pop("topk_idx")
    args = tuple(v.requires_grad_() for v in x.values())
    assert torch.autograd.gradcheck(lambda *a: dsa.sparse_prefill(*a, topk_idx=idx, scale=0.5), args)


@pytest.mark.parametrize("start", [0, 3])
def test_scores_gradient_matches_the_head_sum(start):
    """The reference scores differentiate like sum_h w[h] * ReLU(q[h] . k), masked: each head's gradient lands on
    that head only (zero ReLUs included: some dot products are exactly 0)."""
    torch.manual_seed(4)
    B, T, H, D, S = 2, 5, 3, 4, 9
    q = torch.randn(B, T, H, D, dtype=torch.float64)
    q[0, 1, 2] = 0.0  # a zero dot product for every key
    k, w = torch.randn(B, S, D, dtype=torch.float64), torch.randn(B, T, H, dtype=torch.float64)
    grad = torch.randn(B, T, S, dtype=torch.float64)
    visible = mla.causal_mask(start, B, T, S, q.device)  # [B, T, S]

    def head_sum(q, k, w):
        return (w.unsqueeze(-1) * torch.relu(torch.einsum("bthd,bsd->bths", q, k))).sum(2)  # [B, T, S]

    def reference(q, k, w):
        return dsa.indexer_scores_reference(q, k, w, start_pos=start)

    outs, grads = [], []
    for f in (reference, head_sum):
        inputs = [t.clone().requires_grad_() for t in (q, k, w)]
        out = f(*inputs)
        grads.append(torch.autograd.grad(out, inputs, grad.masked_fill(~visible, 0.0)))
        outs.append(out.detach().masked_fill(~visible, float("-inf")))
    torch.testing.assert_close(outs[0], outs[1])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


def test_empty_batch_with_ragged_start_positions():
    x = testing.make_indexer_inputs(testing.IndexerShape(B=0, T=2, S=5, H=2, D=4, K=3))
    start = torch.zeros(0, dtype=torch.int32)
    assert dsa.indexer_topk(x["q"], x["k"], x["w"], 3, start_pos=start).shape == (0, 2, 3)
    assert dsa.indexer_scores(x["q"], x["k"], x["w"], start_pos=start).shape == (0, 2, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scores_do_not_depend_on_cache_length_or_query_count(dtype):
    """A query's scores are the same bits in a prefill and in a decode against a short or a long cache
    (BLAS picks other kernels, with other summation orders, for few keys: they used to differ by an ulp)."""
    T, H, D = 40, 2, 64
    q = testing.randn((1, T, H, D), seed=1, dtype=dtype)
    k = testing.randn((1, 300, D), seed=2, dtype=dtype)
    w = testing.randn((1, T, H), seed=3).abs()
    prefill = dsa.indexer_scores_reference(q, k[:, :T], w, start_pos=0)  # [1, T, T]
    for t in (0, 3, 10, 39):
        for S in (t + 1, T, 300):
            decode = dsa.indexer_scores_reference(q[:, t:t + 1], k[:, :S], w[:, t:t + 1], start_pos=t)
            assert torch.equal(decode[0, 0, :t + 1], prefill[0, t, :t + 1]), (t, S)


def test_near_tied_keys_keep_their_order_between_prefill_and_decode():
    """Key 1 = key 0 + a nudge orthogonal to the query: scores equal up to rounding. The top-1 of a 4-token
    prefill and of the same query decoded against a 40-slot cache must agree (the RL-stable contract)."""
    g = testing.generator(0)
    for _ in range(200):
        q = torch.randn(1, 4, 1, 64, generator=g)
        k = torch.randn(1, 40, 64, generator=g)
        query = q[0, 3, 0]
        nudge = torch.randn(64, generator=g) * 1e-3
        k[0, 0] = k[0, 0] * torch.sign(k[0, 0] @ query)  # a positive score, so ReLU keeps it
        k[0, 1] = k[0, 0] + nudge - (nudge @ query) / (query @ query) * query
        w = torch.ones(1, 4, 1)
        prefill = dsa.indexer_topk_reference(q, k[:, :4], w, topk=1, start_pos=0)[0, 3]
        decode = dsa.indexer_topk_reference(q[:, 3:], k, w[:, 3:], topk=1, start_pos=3)[0, 0]
        assert torch.equal(prefill, decode)
