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


def _expert_case(shape, dtype, seed=7):
    """x_sorted [M, D] with a crowded expert 0 and (usually) empty experts, plus its counts [E]."""
    ids = torch.randint(0, shape.E, (shape.N, shape.K), generator=testing.generator(seed))
    ids[: shape.N // 2, 0] = 0
    counts = torch.bincount(ids.flatten(), minlength=shape.E)
    weights = testing.make_expert_inputs(shape, dtype=dtype, seed=seed)
    x_sorted = testing.randn((shape.N * shape.K, shape.D), seed=seed + 9, dtype=dtype)
    return x_sorted, counts, weights["w_gate"], weights["w_up"], weights["w_down"]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_experts_match_reference(native, shape, dtype):
    args = _expert_case(shape, dtype)
    got = native_moe.experts(*args)
    want = moe.experts_reference(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    atol, rtol = testing.TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_experts_fp64_against_naive_loop(native):
    """Every routed row through its own expert, one row at a time: the contract without any grouping."""
    shape = SHAPES[3]
    x_sorted, counts, wg, wu, wd = _expert_case(shape, torch.float64)
    got = native_moe.experts(x_sorted, counts, wg, wu, wd)
    expert_of_row = torch.repeat_interleave(torch.arange(shape.E), counts)  # [M]
    for r in range(0, x_sorted.shape[0], 97):
        e, x = int(expert_of_row[r]), x_sorted[r]
        want = (torch.nn.functional.silu(wg[e] @ x) * (wu[e] @ x)) @ wd[e].T
        torch.testing.assert_close(got[r], want, atol=1e-12, rtol=1e-12)


def test_experts_thread_invariance_and_all_rows_in_one_expert(native, threads):
    shape = SHAPES[3]
    x_sorted, counts, wg, wu, wd = _expert_case(shape, torch.float32)
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        outs.append(native_moe.experts(x_sorted, counts, wg, wu, wd))
    assert torch.equal(outs[0], outs[1])  # one thread per expert: the schedule never changes a row's bits
    one = torch.zeros_like(counts)
    one[-1] = x_sorted.shape[0]  # the last expert takes every row, the others none
    torch.testing.assert_close(native_moe.experts(x_sorted, one, wg, wu, wd),
                               moe.experts_reference(x_sorted, one, wg, wu, wd), atol=1e-5, rtol=1e-5)


def test_experts_reject_bad_counts_and_defer_gradients(native):
    shape = SHAPES[1]
    x_sorted, counts, wg, wu, wd = _expert_case(shape, torch.float32)
    bad = counts.clone()
    bad[0] += 1
    with pytest.raises(RuntimeError, match="sum"):
        native_moe.experts(x_sorted, bad, wg, wu, wd)
    kernel = native_moe.KERNELS["moe_experts"]
    assert not kernel.differentiable and kernel.declines((x_sorted.requires_grad_(True), counts, wg, wu, wd), {})
    with torch.no_grad():
        assert kernel.declines((x_sorted, counts, wg, wu, wd), {}) == ""


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_fused_experts_equal_the_three_native_ops(native, shape, dtype):
    """Same arithmetic as dispatch -> experts -> combine (bitwise), and the reference within tolerance."""
    ids = torch.randint(0, shape.E, (shape.N, shape.K), generator=testing.generator(21)).to(torch.int32)
    ids[: shape.N // 2, 0] = 0  # a crowded expert, (usually) empty ones; repeats within a token are allowed
    w = testing.make_expert_inputs(shape, dtype=dtype, seed=23)
    weights = testing.randn((shape.N, shape.K), seed=24).to(dtype)
    got = native_moe.fused_experts(w["x"], weights, ids, w["w_gate"], w["w_up"], w["w_down"])
    x_sorted, sort_idx, counts = native_moe.dispatch(w["x"], ids, num_experts=shape.E)
    y = native_moe.experts(x_sorted, counts, w["w_gate"], w["w_up"], w["w_down"])
    assert got.dtype == dtype and torch.equal(got, native_moe.combine(y, sort_idx, weights))
    want = moe.fused_experts_reference(w["x"], weights, ids, w["w_gate"], w["w_up"], w["w_down"])
    atol, rtol = testing.TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_fused_experts_thread_invariance(native, threads):
    shape = SHAPES[3]
    w = testing.make_expert_inputs(shape, seed=30)
    weights, ids = moe.route_reference(testing.make_route_inputs(shape, seed=31)["logits"], None, top_k=shape.K)
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        outs.append(native_moe.fused_experts(w["x"], weights, ids, w["w_gate"], w["w_up"], w["w_down"]))
    assert torch.equal(outs[0], outs[1])
    why = native_moe.KERNELS["moe_fused_experts"].declines(
        (w["x"].requires_grad_(True), weights, ids, w["w_gate"], w["w_up"], w["w_down"]), {})
    assert why == "" and native_moe.KERNELS["moe_fused_experts"].differentiable, why  # native backward


INFERENCE_MODE_SCRIPT = """
import torch
from glm5_core import testing
from glm5_core.backends.cpu import backend, moe as native_moe
assert backend.status().built
shape = testing.MoEShape(N=40, E=6, K=2, G=1, TG=1, D=16, F=8)
w = testing.make_expert_inputs(shape, seed=1)
ids = torch.randint(0, shape.E, (shape.N, shape.K), generator=testing.generator(2))
weights = testing.randn((shape.N, shape.K), seed=3)
args = (w["x"], weights, ids, w["w_gate"], w["w_up"], w["w_down"])
with torch.no_grad():
    want = native_moe.fused_experts(*args)
with torch.inference_mode():
    got = native_moe.fused_experts(*args)
    x_sorted, sort_idx, counts = native_moe.dispatch(w["x"], ids, num_experts=shape.E)
    y = native_moe.experts(x_sorted, counts, w["w_gate"], w["w_up"], w["w_down"])
assert torch.equal(got, want) and torch.equal(native_moe.combine(y, sort_idx, weights), want)
print("inference mode ok")
"""


def test_experts_run_under_inference_mode(native):
    """The expert tasks run ATen ops on OpenMP threads: they must see the caller's inference mode (an error
    inside the parallel region would abort the whole process, hence the subprocess)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", INFERENCE_MODE_SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "inference mode ok" in done.stdout, done.stderr[-2000:]
