"""Native MoE selection / dispatch / combine vs the reference: ids and permutations are exact."""
import pytest
import torch

from glm5_core import testing
from glm5_core.backends.cpu import moe as native_moe
from glm5_core.ops import moe

SHAPES = testing.MOE_SHAPES + (testing.MoEShape(N=301, E=64, K=8, G=8, TG=3, D=40, F=8),
                               testing.MoEShape(N=50, E=9, K=9, G=1, TG=1, D=7, F=3))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("ties", (None, "integer"))
@pytest.mark.parametrize("score_func", ("sigmoid", "softmax"))
def test_route_matches_reference(native, shape, dtype, ties, score_func):
    inputs = testing.make_route_inputs(shape, dtype=dtype, seed=6, ties=ties)
    kwargs = dict(top_k=shape.K, score_func=score_func, n_group=shape.G, topk_group=shape.TG,
                  renormalize=True, routed_scaling_factor=2.5)
    w, ids = native_moe.route(inputs["logits"], inputs["bias"], **kwargs)
    w_ref, ids_ref = moe.route_reference(inputs["logits"], inputs["bias"], **kwargs)
    assert ids.dtype == torch.int32 and torch.equal(ids, ids_ref)
    assert w.dtype == w_ref.dtype
    atol, rtol = testing.TOLERANCES[w_ref.dtype]
    torch.testing.assert_close(w, w_ref, atol=atol, rtol=rtol)


def test_route_keeps_weights_differentiable(native):
    inputs = testing.make_route_inputs(SHAPES[2], seed=1)
    logits = inputs["logits"].requires_grad_(True)
    w, _ = native_moe.route(logits, inputs["bias"], top_k=4, n_group=4, topk_group=2)
    w.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_dispatch_and_combine_match_reference(native, shape, dtype):
    ids = torch.randint(0, shape.E, (shape.N, shape.K), generator=testing.generator(3)).to(torch.int32)
    ids[: shape.N // 2] = 0  # a crowded expert, and (usually) empty ones
    x = testing.randn((shape.N, shape.D), seed=4, dtype=dtype)
    got = native_moe.dispatch(x, ids, num_experts=shape.E)
    want = moe.dispatch_reference(x, ids, num_experts=shape.E)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and torch.equal(g, r)
    y = testing.randn((shape.N * shape.K, shape.D), seed=5, dtype=dtype)
    weights = testing.randn((shape.N, shape.K), seed=6)
    out = native_moe.combine(y, want[1], weights)
    ref = moe.combine_reference(y, want[1], weights)
    assert out.dtype == ref.dtype and torch.equal(out, ref)  # same ops in the same order


def test_combine_thread_invariance(native, threads):
    shape = SHAPES[3]
    y = testing.randn((shape.N * shape.K, shape.D), seed=5)
    sort_idx = torch.randperm(shape.N * shape.K, generator=testing.generator(2))
    weights = testing.randn((shape.N, shape.K), seed=6)
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        outs.append(native_moe.combine(y, sort_idx, weights))
    assert torch.equal(outs[0], outs[1])


def test_route_batch_invariance_bitwise(native):
    shape = SHAPES[3]
    inputs = testing.make_route_inputs(shape, seed=9)
    kwargs = dict(top_k=shape.K, n_group=shape.G, topk_group=shape.TG, routed_scaling_factor=2.5)
    w_all, ids_all = native_moe.route(inputs["logits"], inputs["bias"], **kwargs)
    for n0, n1 in ((0, 1), (1, 17), (17, 301)):
        w, ids = native_moe.route(inputs["logits"][n0:n1], inputs["bias"], **kwargs)
        assert torch.equal(ids, ids_all[n0:n1]) and torch.equal(w, w_all[n0:n1])
