"""The MoE reference: routing contract, dispatch / combine, grouped experts, bias update."""
import math

import pytest
import torch
import torch.nn.functional as F

from glm5_core import testing
from glm5_core.ops import moe


def brute_force_route(logits, bias, top_k, score_func, n_group, topk_group, renormalize, scale):
    N, E = logits.shape
    ids_out, w_out = [], []
    for n in range(N):
        row = [float(v) for v in logits[n].double()]
        if score_func == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            scores = [math.exp(v - m) / z for v in row]
        select = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        per = E // n_group
        group_score = [sum(sorted(select[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        eligible = [e for e in range(E) if e // per in kept]
        ids = sorted(eligible, key=lambda e: (-select[e], e))[:top_k]
        w = [scores[e] for e in ids]
        if renormalize:
            total = sum(w) + moe.RENORM_EPS
            w = [v / total for v in w]
        ids_out.append(ids)
        w_out.append([v * scale for v in w])
    return torch.tensor(w_out, dtype=torch.float64), torch.tensor(ids_out, dtype=torch.int32)


@pytest.mark.parametrize("shape", testing.MOE_SHAPES, ids=str)
@pytest.mark.parametrize("score_func", moe.SCORE_FUNCS)
@pytest.mark.parametrize("ties", [None, "integer"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_brute_force(shape, score_func, ties, renormalize):
    x = testing.make_route_inputs(shape, dtype=torch.float64, seed=3, ties=ties)
    kw = dict(top_k=shape.K, score_func=score_func, n_group=shape.G, topk_group=shape.TG, renormalize=renormalize,
              routed_scaling_factor=2.5)
    weights, ids = moe.route(x["logits"], x["bias"], **kw)
    want_w, want_ids = brute_force_route(x["logits"], x["bias"], shape.K, score_func, shape.G, shape.TG,
                                         renormalize, 2.5)
    assert ids.dtype == torch.int32 and torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_w, atol=1e-12, rtol=1e-12)


def test_bias_changes_selection_but_not_weights():
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    bias = torch.tensor([1.0, 0.0, 0.0, 0.0])
    w, ids = moe.route(logits, bias, top_k=1, renormalize=False)
    assert ids.tolist() == [[0]]
    assert torch.allclose(w, torch.sigmoid(logits[:, :1]))


def test_group_limit_keeps_best_groups_by_top2_sum():
    # sigmoid scores: group 0 {0.993, 0.007} sums to 1.0; group 1 {0.881, 0.881} sums to 1.76 -> group 1 wins
    # although expert 0 has the best single score.
    logits = torch.tensor([[5.0, -5.0, 2.0, 2.0]])
    _, ids = moe.route(logits, None, top_k=2, n_group=2, topk_group=1, renormalize=False)
    assert ids.tolist() == [[2, 3]]


@pytest.mark.parametrize("shape", testing.MOE_SHAPES, ids=str)
def test_dispatch_is_stable_and_combine_inverts_it(shape):
    x = testing.make_expert_inputs(shape, dtype=torch.float64, seed=2)["x"]
    weights, ids = moe.route(testing.make_route_inputs(shape, seed=4)["logits"], None, top_k=shape.K)
    x_sorted, sort_idx, counts = moe.dispatch(x, ids, num_experts=shape.E)
    assert counts.tolist() == torch.bincount(ids.flatten().long(), minlength=shape.E).tolist()
    experts_of_rows = ids.flatten()[sort_idx]
    assert (experts_of_rows[1:] >= experts_of_rows[:-1]).all()  # grouped by expert
    for e in range(shape.E):  # token order kept inside each expert
        rows = sort_idx[experts_of_rows == e]
        assert (rows[1:] > rows[:-1]).all()
    assert torch.equal(x_sorted, x[sort_idx // shape.K])
    out = moe.combine(x_sorted, sort_idx, weights.double())  # identity experts
    assert torch.allclose(out, x * weights.double().sum(-1, keepdim=True), atol=1e-12)


def test_combine_reference_takes_an_int32_sort_idx():
    """The public combine accepts int32 sort_idx; the reference is what every kernel falls back to."""
    weights = torch.rand(5, 3, dtype=torch.float64)
    y = torch.randn(15, 4, dtype=torch.float64)
    sort_idx = torch.randperm(15, generator=torch.Generator().manual_seed(0))
    expected = moe.combine_reference(y, sort_idx, weights)
    torch.testing.assert_close(moe.combine_reference(y, sort_idx.int(), weights), expected, rtol=0, atol=0)


def test_combine_reference_is_defined_when_sort_idx_repeats():
    """Issue 35 item 7: with value checks off a repeated sort_idx reached the reference, whose inverse was
    torch.empty: assignments no row named read whatever memory held. Now: the last row naming an assignment,
    row 0 for one no row names, the same on every call."""
    N, K, D = 4, 2, 3
    y = torch.arange(N * K * D, dtype=torch.float64).view(N * K, D) + 1
    weights = torch.ones(N, K, dtype=torch.float64)
    sort_idx = torch.tensor([0, 1, 2, 3, 3, 5, 6, 7])  # row 4 names assignment 3 again; assignment 4: no row
    rows = [0, 1, 2, 4, 0, 5, 6, 7]  # assignment -> row as documented
    expected = y[rows].view(N, K, D).sum(1)
    for _ in range(3):
        poison = torch.full((N * K,), 6, dtype=torch.int64)  # freed memory the next empty() may return
        del poison
        torch.testing.assert_close(moe.combine_reference(y, sort_idx, weights), expected, rtol=0, atol=0)
        torch.testing.assert_close(moe.combine_reference(y, sort_idx.int(), weights), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="permutation"):  # with value checks on, combine refuses it
        moe.combine(y, sort_idx, weights, backend="cpu")


@pytest.mark.parametrize("shape", testing.MOE_SHAPES, ids=str)
def test_experts_matches_per_token_loop(shape):
    x = testing.make_expert_inputs(shape, dtype=torch.float64, seed=6)
    _, ids = moe.route(testing.make_route_inputs(shape, seed=7)["logits"], None, top_k=shape.K)
    x_sorted, sort_idx, counts = moe.dispatch(x["x"], ids, num_experts=shape.E)
    out = moe.experts(x_sorted, counts, x["w_gate"], x["w_up"], x["w_down"])
    expert_of_row = ids.flatten()[sort_idx].long()
    for m in range(x_sorted.shape[0]):
        e = int(expert_of_row[m])
        h = F.silu(x["w_gate"][e] @ x_sorted[m]) * (x["w_up"][e] @ x_sorted[m])
        assert torch.allclose(out[m], x["w_down"][e] @ h, atol=1e-12)


def test_experts_with_no_tokens_are_skipped():
    shape = testing.MoEShape(N=3, E=5, K=1, G=1, TG=1, D=4, F=3)
    x = testing.make_expert_inputs(shape, dtype=torch.float64)
    counts = torch.tensor([0, 3, 0, 0, 0])
    out = moe.experts(x["x"], counts, x["w_gate"], x["w_up"], x["w_down"])
    h = F.silu(x["x"] @ x["w_gate"][1].T) * (x["x"] @ x["w_up"][1].T)
    assert torch.allclose(out, h @ x["w_down"][1].T)


def test_update_bias_moves_towards_balance():
    bias = torch.zeros(4)
    load = torch.tensor([10, 2, 4, 4])  # mean 5
    assert moe.update_bias(bias, load, 0.01).tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert torch.equal(moe.update_bias(bias, torch.tensor([3, 3, 3, 3]), 0.5), bias)


@pytest.mark.parametrize("dtype,very_negative", [(torch.float32, -100.0), (torch.float64, -800.0)])
def test_route_gradient_is_finite_when_a_score_underflows(dtype, very_negative):
    """exp(-x) overflows to inf for such logits; the sigmoid's gradient there is ~0, never NaN (torch.sigmoid's)."""
    logits = torch.tensor([[2.0, 1.0, very_negative, 0.5], [very_negative, 0.3, -1.0, 3.0]], dtype=dtype,
                          requires_grad=True)
    weights, ids = moe.route_reference(logits, None, top_k=2, routed_scaling_factor=2.5)
    cotangent = testing.randn(weights.shape, seed=1, dtype=weights.dtype)
    (grad,) = torch.autograd.grad(weights, logits, cotangent)
    twin = logits.detach().clone().requires_grad_()
    scores = torch.sigmoid(twin).gather(1, ids.long())
    want_weights = scores / (scores.sum(-1, keepdim=True) + moe.RENORM_EPS) * 2.5
    (want,) = torch.autograd.grad(want_weights, twin, cotangent)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, want)


def test_route_reference_sigmoid_has_second_derivatives():
    logits = testing.randn((3, 5), seed=2, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x: moe.route_reference(x, None, top_k=2)[0], (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_update_bias_compares_loads_exactly_whatever_the_bias_dtype(dtype):
    # Loads a few tokens apart around the mean: bf16 / fp16 cannot tell them apart, the rule must.
    load = torch.tensor([20000, 20100, 20030, 20070, 20049, 20051])  # mean 20050
    mean = float(load.double().mean())
    bias = torch.zeros(6, dtype=dtype)
    got = moe.update_bias(bias, load, 0.5)
    want = [0.5 if mean > float(v) else -0.5 for v in load]
    assert got.dtype == dtype and got.tolist() == want


def test_zero_slots_per_token_combine_to_zeros():
    """K=0: every output row is the empty sum (the cpu kernel's answer; the reference raised IndexError)."""
    x = testing.randn((3, 4), seed=1)
    w_gate, w_up, w_down = (testing.randn((2, 5, 4), seed=2), testing.randn((2, 5, 4), seed=3),
                            testing.randn((2, 4, 5), seed=4))
    weights, ids = torch.zeros(3, 0), torch.zeros(3, 0, dtype=torch.int32)
    assert torch.equal(moe.fused_experts_reference(x, weights, ids, w_gate, w_up, w_down), torch.zeros(3, 4))
    y_sorted = torch.zeros(0, 4, requires_grad=True)
    assert torch.equal(moe.combine(y_sorted, torch.zeros(0, dtype=torch.int64), weights), torch.zeros(3, 4))
