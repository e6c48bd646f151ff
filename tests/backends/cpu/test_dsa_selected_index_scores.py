"""Native indexer scores at the selected keys (forward + backward) vs the reference's autograd, judged against an
fp64 reference run: odd shapes, K = 1, -1-padded rows (and K past the keys), int32 and int64 indices, bf16 inputs;
the backward bitwise repeatable across runs and thread counts; both custom ops through ``opcheck``; the registry
routes training calls to the kernel."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends.cpu import dsa as native_dsa
from glm5_core.ops import dsa

SHAPES = (
    (testing.IndexerShape(B=1, T=1, S=1, H=1, D=8, K=1), 0),  # K = 1, one key
    (testing.IndexerShape(B=2, T=5, S=13, H=3, D=12, K=1), 8),  # K = 1
    (testing.IndexerShape(B=2, T=7, S=11, H=3, D=5, K=4), 0),  # odd sizes, early rows -1 padded
    (testing.IndexerShape(B=1, T=9, S=9, H=2, D=8, K=20), 0),  # K > S: -1 padding everywhere
    (testing.IndexerShape(B=2, T=33, S=300, H=5, D=19, K=40), 267),  # keys shared by many queries
    (testing.IndexerShape(B=1, T=6, S=50, H=19, D=16, K=11), 44),  # heads past one vector (fp32 and fp64)
    (testing.IndexerShape(B=2, T=20, S=60, H=8, D=64, K=24), 40),  # the training config's heads: whole 8-row tiles
    (testing.IndexerShape(B=1, T=9, S=30, H=11, D=40, K=7), 21),  # tile rows + remainder, 2 vectors of d + a tail
)
NAMES = ("q", "k", "w")


def _inputs(shape, start, dtype, seed, index_dtype=torch.int32):
    x = testing.make_indexer_inputs(shape, dtype=dtype, seed=seed)
    idx = dsa.indexer_topk_reference(x["q"].float(), x["k"].float(), x["w"].float(), topk=shape.K, start_pos=start)
    if shape.K > 1 and shape.T > 3:
        idx[0, shape.T - 1, 0] = -1  # a -1 slot in the middle of a full row
    return x, idx.to(index_dtype)


def _grads(fn, x, idx, cotangent):
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in NAMES}
    out = fn(*(leaves[n] for n in NAMES), idx)
    keep = idx >= 0
    out.masked_fill(~keep, 0.0).backward(cotangent.to(out.dtype).masked_fill(~keep, 0.0))
    return out.detach(), {n: leaves[n].grad for n in NAMES}


def _as64(x):
    return {n: t.to(torch.float64) for n, t in x.items()}


@pytest.mark.parametrize("shape,start", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=str)
def test_scores_and_gradients_match_the_reference(native, shape, start, dtype, index_dtype):
    x, idx = _inputs(shape, start, dtype, seed=5, index_dtype=index_dtype)
    cotangent = testing.randn(idx.shape, seed=6)
    out, got = _grads(native_dsa.selected_index_scores, x, idx, cotangent)
    ref_out, same_precision = _grads(dsa.selected_index_scores_reference, x, idx, cotangent)
    exact_out, exact = _grads(dsa.selected_index_scores_reference, _as64(x), idx, cotangent.double())
    keep = idx >= 0
    assert out.dtype == ref_out.dtype and torch.equal(torch.isneginf(out), ~keep)
    verdict = testing.compare_to_fp64(out[keep], ref_out[keep], exact_out[keep], dtype)
    assert verdict.passed, f"scores: {verdict.detail}"
    for name in NAMES:
        assert got[name].dtype == x[name].dtype
        verdict = testing.compare_to_fp64(got[name], same_precision[name], exact[name], dtype)
        assert verdict.passed, f"d{name}: {verdict.detail}"


def test_keys_never_selected_get_zero_gradient(native):
    shape, start = SHAPES[4]
    x, idx = _inputs(shape, start, torch.float32, seed=7)
    idx = idx.clamp(max=150)  # keys 151.. are never selected
    _, got = _grads(native_dsa.selected_index_scores, x, idx, testing.randn(idx.shape, seed=8))
    assert not got["k"][:, 151:].any() and got["k"][:, :151].any()


def test_a_row_with_no_key_gets_zero_gradient_and_ignores_its_cotangent(native):
    shape, start = SHAPES[2]
    x, idx = _inputs(shape, start, torch.float32, seed=9)
    idx[1, 2] = -1
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in NAMES}
    out = native_dsa.selected_index_scores(*(leaves[n] for n in NAMES), idx)
    out.backward(torch.full_like(out, float("nan")).masked_fill(idx >= 0, 1.0))  # NaN only at the -1 slots
    assert all(torch.isfinite(leaves[n].grad).all() for n in NAMES)
    assert not leaves["q"].grad[1, 2].any() and not leaves["w"].grad[1, 2].any()


def test_gradcheck_fp64(native, threads):
    torch.set_num_threads(1)  # some thousand tiny calls
    shape = testing.IndexerShape(B=2, T=4, S=6, H=2, D=3, K=3)
    x, idx = _inputs(shape, 2, torch.float64, seed=10)
    x = _as64(x)  # w comes in fp32
    keep = idx >= 0
    leaves = [x[n].detach().clone().requires_grad_(True) for n in NAMES]
    assert torch.autograd.gradcheck(
        lambda q, k, w: native_dsa.selected_index_scores(q, k, w, idx).masked_fill(~keep, 0.0), leaves, eps=1e-6,
        atol=1e-7)


def test_backward_is_bitwise_repeatable_across_runs_and_thread_counts(native, threads):
    shape, start = SHAPES[4]
    x, idx = _inputs(shape, start, torch.float32, seed=11)
    cotangent = testing.randn(idx.shape, seed=12)
    results = []
    for n in (1, 2, 3, 2):
        torch.set_num_threads(n)
        out, grads = _grads(native_dsa.selected_index_scores, x, idx, cotangent)
        results.append((out,) + tuple(grads[name] for name in NAMES))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_custom_ops_pass_opcheck(native, dtype):
    shape, start = SHAPES[2]
    x, idx = _inputs(shape, start, dtype, seed=13)
    x = {n: t.to(dtype) for n, t in x.items()}  # one dtype for q, k and w
    torch.library.opcheck(torch.ops.glm5_cpu.selected_index_scores, (x["q"], x["k"], x["w"], idx))
    grad = testing.randn(idx.shape, seed=14, dtype=dtype)
    torch.library.opcheck(torch.ops.glm5_cpu.selected_index_scores_backward, (grad, x["q"], x["k"], x["w"], idx))


def test_kernel_rejects_an_index_outside_the_keys(native):
    shape, start = SHAPES[2]
    x, idx = _inputs(shape, start, torch.float32, seed=15)
    for bad_value in (shape.S, -2):
        bad = idx.clone()
        bad[1, 3, 0] = bad_value
        with pytest.raises(IndexError, match="outside"):
            torch.ops.glm5_cpu.selected_index_scores(x["q"], x["k"], x["w"], bad)
        with pytest.raises(IndexError, match="outside"):
            torch.ops.glm5_cpu.selected_index_scores_backward(torch.ones(idx.shape), x["q"], x["k"], x["w"], bad)


def test_entry_point_names_a_bad_argument():
    shape, start = SHAPES[2]
    x, idx = _inputs(shape, start, torch.float32, seed=16)
    with pytest.raises(ValueError, match="topk_idx: expected entries in"):
        dsa.selected_index_scores(x["q"], x["k"], x["w"], idx.clamp(min=0) + shape.S)
    with pytest.raises(TypeError, match="topk_idx: expected dtype"):
        dsa.selected_index_scores(x["q"], x["k"], x["w"], idx.float())
    with pytest.raises(ValueError, match="w: expected"):
        dsa.selected_index_scores(x["q"], x["k"], x["w"][:, :, :1], idx)


def test_training_calls_take_the_native_kernel(native):
    shape, start = SHAPES[2]
    x, idx = _inputs(shape, start, torch.float32, seed=17)
    leaves = [x[n].detach().clone().requires_grad_(True) for n in NAMES]
    with registry.record_reference_runs() as ran:
        out = dsa.selected_index_scores(*leaves, idx, backend="cpu")
    assert ran == [] and out.grad_fn is not None
    out.masked_fill(idx < 0, 0.0).sum().backward()
    assert all(leaf.grad is not None for leaf in leaves)
