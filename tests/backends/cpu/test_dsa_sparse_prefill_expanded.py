"""Native expanded-form sparse MLA prefill (forward + backward) vs the reference (judged against an fp64 reference
run): odd shapes, T != S, K = 1, K past the causal keys (-1 padding), a query with no key, H = 1, odd head dims,
fp32 / bf16 / fp64; a backward over several blocks of rows; strided per-head keys (views of one kv_b_proj output);
bitwise repeatable backward across runs and thread counts; the custom ops through ``opcheck``; the registry routes
training calls to it; the expanded and absorbed forms agree."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends.cpu import dsa as native_dsa
from glm5_core.ops import dsa
from tests.backends.cpu.sparse_grads import as_fp64, grads

SHAPES = (
    (testing.MLAShape(B=1, T=1, S=1, H=1, Dn=8, Dr=4, Dv=8, C=16), 1),  # K = 1, the only row has no key
    (testing.MLAShape(B=2, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24), 1),  # K = 1, T != S
    (testing.MLAShape(B=2, T=7, S=11, H=1, Dn=5, Dr=3, Dv=7, C=13), 4),  # H = 1, odd sizes, early rows -1 padded
    (testing.MLAShape(B=1, T=9, S=9, H=2, Dn=8, Dr=4, Dv=6, C=10), 20),  # K > S: -1 padding everywhere
    (testing.MLAShape(B=2, T=3, S=300, H=5, Dn=17, Dr=9, Dv=19, C=37), 200),  # many keys, dims past a vector
)
DIFFERENTIABLE = ("q_nope", "q_pe", "k_nope", "k_pe", "v")


def _grads(fn, inputs, grad_out, scale=0.3):
    return grads(fn, inputs, grad_out, DIFFERENTIABLE, scale=scale)


@pytest.mark.parametrize("shape,K", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_forward_and_gradients_match_the_reference(native, shape, K, dtype):
    inputs = testing.make_sparse_expanded_inputs(shape, K, dtype=dtype, seed=5)
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=6)
    out, got = _grads(native_dsa.sparse_prefill_expanded, inputs, grad_out)
    ref_out, same_precision = _grads(dsa.sparse_prefill_expanded_reference, inputs, grad_out)
    exact_out, exact = _grads(dsa.sparse_prefill_expanded_reference, as_fp64(inputs), grad_out.double())
    verdict = testing.compare_to_fp64(out, ref_out, exact_out, dtype)
    assert out.dtype == dtype and verdict.passed, f"out: {verdict.detail}"
    for name in DIFFERENTIABLE:
        assert got[name].dtype == dtype and got[name].shape == inputs[name].shape
        verdict = testing.compare_to_fp64(got[name], same_precision[name], exact[name], dtype)
        assert verdict.passed, f"{name}: {verdict.detail}"
    assert not out[0, 0].any() and not got["q_nope"][0, 0].any()  # the query with no key: zeros, no gradient


@pytest.mark.parametrize("scale", (4.0, 40.0), ids=str)
def test_peaked_softmax_matches_the_reference(native, scale):
    """Scores spread over hundreds: most p underflow to 0 (the fp32 exp's range ends) and a few keys carry the
    softmax; the output and the gradients (D = dO . out in the backward) still match the reference."""
    shape, K = SHAPES[4]
    inputs = testing.make_sparse_expanded_inputs(shape, K, seed=23)
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=24)
    out, got = _grads(native_dsa.sparse_prefill_expanded, inputs, grad_out, scale=scale)
    ref_out, same_precision = _grads(dsa.sparse_prefill_expanded_reference, inputs, grad_out, scale=scale)
    exact_out, exact = _grads(dsa.sparse_prefill_expanded_reference, as_fp64(inputs), grad_out.double(), scale=scale)
    assert testing.compare_to_fp64(out, ref_out, exact_out, torch.float32).passed
    for name in DIFFERENTIABLE:
        verdict = testing.compare_to_fp64(got[name], same_precision[name], exact[name], torch.float32)
        assert verdict.passed, f"{name}: {verdict.detail}"


def test_inference_forward_matches_the_training_forward(native):
    shape, K = SHAPES[4]
    inputs = testing.make_sparse_expanded_inputs(shape, K, seed=3)
    with torch.no_grad():
        plain = native_dsa.sparse_prefill_expanded(**inputs, scale=0.3)
    trained, _ = _grads(native_dsa.sparse_prefill_expanded, inputs, torch.ones_like(plain))
    assert torch.equal(plain, trained)


def test_strided_key_views_give_the_same_results(native):
    """k_nope and v as the two halves of one [B, S, H, Dn + Dv] tensor (what kv_b_proj gives), q_nope a view."""
    shape, K = SHAPES[1]
    x = testing.make_sparse_expanded_inputs(shape, K, seed=4)
    kv = torch.cat([x["k_nope"], x["v"]], dim=-1)  # [B, S, H, Dn + Dv]
    q = torch.cat([x["q_nope"], x["q_pe"]], dim=-1)  # [B, T, H, Dn + Dr]
    views = dict(x, k_nope=kv[..., :shape.Dn], v=kv[..., shape.Dn:], q_nope=q[..., :shape.Dn])
    assert not views["k_nope"].is_contiguous() and not views["v"].is_contiguous()
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=8)
    out, grads = _grads(native_dsa.sparse_prefill_expanded, x, grad_out)
    out_v, grads_v = _grads(native_dsa.sparse_prefill_expanded, views, grad_out)
    assert torch.equal(out, out_v) and all(torch.equal(grads[n], grads_v[n]) for n in DIFFERENTIABLE)


def test_expanded_and_absorbed_forms_agree(native):
    shape, K = SHAPES[4]
    latent = testing.make_sparse_inputs(shape, K, seed=9)
    expanded = testing.make_sparse_expanded_inputs(shape, K, seed=9)
    absorbed = dsa.sparse_attention_reference(**as_fp64(latent), scale=0.3)
    out = native_dsa.sparse_prefill_expanded(**expanded, scale=0.3)
    assert torch.allclose(out.double(), absorbed, atol=1e-5, rtol=1e-4)


def test_keys_never_selected_get_zero_gradient(native):
    shape, K = SHAPES[4]
    inputs = testing.make_sparse_expanded_inputs(shape, K, seed=7)
    inputs["topk_idx"] = inputs["topk_idx"].clamp(max=150)  # keys 151.. are never selected
    _, got = _grads(native_dsa.sparse_prefill_expanded, inputs,
                    testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=8))
    for name in ("k_nope", "k_pe", "v"):
        assert not got[name][:, 151:].any() and got[name][:, :151].any()


def test_gradcheck_fp64(native, threads):
    torch.set_num_threads(1)  # some thousand tiny calls
    shape, K = testing.MLAShape(B=1, T=3, S=4, H=2, Dn=3, Dr=2, Dv=3, C=4), 2
    inputs = as_fp64(testing.make_sparse_expanded_inputs(shape, K, seed=9, start_pos=1))
    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in DIFFERENTIABLE]
    idx = inputs["topk_idx"]
    assert torch.autograd.gradcheck(lambda *a: native_dsa.sparse_prefill_expanded(*a, idx, scale=0.4), leaves,
                                    eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_backward_is_bitwise_repeatable_across_runs_and_thread_counts(native, threads, dtype):
    shape, K = SHAPES[4]
    inputs = testing.make_sparse_expanded_inputs(shape, K, dtype=dtype, seed=10)
    inputs["topk_idx"][1] = inputs["topk_idx"][1].clamp(max=40)  # many queries share a key: long per-key sums
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=11)
    results = []
    for n in (1, 2, 3, 2):
        torch.set_num_threads(n)
        _, grads = _grads(native_dsa.sparse_prefill_expanded, inputs, grad_out)
        results.append(grads)
    for other in results[1:]:
        assert all(torch.equal(results[0][n], other[n]) for n in DIFFERENTIABLE)


def test_gradients_summed_over_several_row_blocks(native, threads):
    """K = 1024 selected keys per query: the backward's p / G of a block of rows (4 MiB) holds 64 rows, so the 80 rows
    go through in two blocks and most keys collect gradient terms from both (one from each batch row's rows)."""
    shape, K = testing.MLAShape(B=2, T=40, S=1100, H=3, Dn=6, Dr=4, Dv=5, C=8), 1024
    inputs = testing.make_sparse_expanded_inputs(shape, K, seed=21)
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=22)
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        results.append(_grads(native_dsa.sparse_prefill_expanded, inputs, grad_out)[1])
    _, same_precision = _grads(dsa.sparse_prefill_expanded_reference, inputs, grad_out)
    _, exact = _grads(dsa.sparse_prefill_expanded_reference, as_fp64(inputs), grad_out.double())
    for name in DIFFERENTIABLE:
        assert torch.equal(results[0][name], results[1][name]), name
        verdict = testing.compare_to_fp64(results[0][name], same_precision[name], exact[name], torch.float32)
        assert verdict.passed, f"{name}: {verdict.detail}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_custom_ops_pass_opcheck(native, dtype):
    shape, K = SHAPES[2]
    x = testing.make_sparse_expanded_inputs(shape, K, dtype=dtype, seed=14)
    q_nope, q_pe = x["q_nope"].float(), x["q_pe"].float()
    keys = (x["k_nope"], x["k_pe"], x["v"], x["topk_idx"])
    torch.library.opcheck(torch.ops.glm5_cpu.sparse_expanded_forward, (q_nope, q_pe, *keys, 0.3))
    out, lse = torch.ops.glm5_cpu.sparse_expanded_forward(q_nope, q_pe, *keys, 0.3)
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=16)
    torch.library.opcheck(torch.ops.glm5_cpu.sparse_expanded_backward,
                          (grad_out, q_nope, q_pe, *keys, out, lse, 0.3))


def test_kernels_reject_an_index_past_the_keys(native):
    shape, K = SHAPES[2]
    x = testing.make_sparse_expanded_inputs(shape, K, seed=17)
    bad = x["topk_idx"].clone()
    bad[1, 3, 0] = shape.S
    args = (x["q_nope"], x["q_pe"], x["k_nope"], x["k_pe"], x["v"], bad, 0.3)
    with pytest.raises(IndexError, match="past the keys"):
        torch.ops.glm5_cpu.sparse_expanded_forward(*args)
    lse, out = torch.zeros(shape.B, shape.T, shape.H), torch.zeros(shape.B, shape.T, shape.H, shape.Dv)
    with pytest.raises(IndexError, match="past the keys"):
        torch.ops.glm5_cpu.sparse_expanded_backward(torch.ones(shape.B, shape.T, shape.H, shape.Dv), *args[:6], out,
                                                    lse, 0.3)


def test_training_calls_take_the_native_kernel(native):
    shape, K = SHAPES[2]
    inputs = testing.make_sparse_expanded_inputs(shape, K, seed=19)
    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in DIFFERENTIABLE]
    with registry.record_reference_runs() as ran:
        out = dsa.sparse_prefill_expanded(*leaves, inputs["topk_idx"], scale=0.3, backend="cpu")
    assert ran == [] and out.grad_fn is not None
    out.sum().backward()
    assert all(leaf.grad is not None for leaf in leaves)


def test_entry_point_names_the_bad_argument():
    shape, K = SHAPES[2]
    x = testing.make_sparse_expanded_inputs(shape, K, seed=20)
    with pytest.raises(ValueError, match="v: expected"):
        dsa.sparse_prefill_expanded(**dict(x, v=x["v"][:, :-1]), scale=0.3)
    with pytest.raises(ValueError, match="k_nope: expected"):
        dsa.sparse_prefill_expanded(**dict(x, k_nope=x["k_nope"][..., 1:]), scale=0.3)
    with pytest.raises(ValueError, match="topk_idx"):
        dsa.sparse_prefill_expanded(**dict(x, topk_idx=x["topk_idx"] + shape.S), scale=0.3)
    with pytest.raises(TypeError, match="dtype"):
        dsa.sparse_prefill_expanded(**dict(x, v=x["v"].double()), scale=0.3)


def _native_forward_backward(x, grad_out, scale):
    args = (x["q_nope"], x["q_pe"], x["k_nope"], x["k_pe"], x["v"], x["topk_idx"])
    out, lse = torch.ops.glm5_cpu.sparse_expanded_forward(*args, scale)
    return (out, lse) + tuple(torch.ops.glm5_cpu.sparse_expanded_backward(grad_out, *args, out, lse, scale))


PACKED_SHAPES = (
    (testing.MLAShape(B=1, T=1, S=1, H=4, Dn=8, Dr=4, Dv=8, C=16), 1),  # K = 1: the only row has no key
    (testing.MLAShape(B=2, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24), 1),  # K = 1 (an odd key count), T != S
    (testing.MLAShape(B=2, T=7, S=11, H=1, Dn=5, Dr=3, Dv=7, C=13), 4),  # odd widths (quad rows padded), -1 slots
    (testing.MLAShape(B=1, T=9, S=9, H=2, Dn=17, Dr=9, Dv=19, C=10), 20),  # K > S: -1 padding everywhere
    (testing.MLAShape(B=2, T=33, S=300, H=4, Dn=16, Dr=8, Dv=16, C=37), 37),  # the tiny preset's widths, odd K
)


@pytest.mark.parametrize("shape,K", PACKED_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("nthreads", (1, 2))
def test_packed_heads_are_bitwise_the_eight_lane_kernels(native, threads, shape, K, dtype, nthreads):
    """H <= 4 heads take the packed kernels (two keys / two elements per 8-lane vector); the same problem with heads
    added up to 5 takes the 8-lane kernels, whose per-head results do not depend on the other heads. The added
    heads have zero queries and zero grad_out, so their d k_pe terms are +0 and the head sum keeps its bits too:
    every output of the packed kernels must equal the 8-lane kernels' bit for bit (forward, lse, every gradient)."""
    torch.set_num_threads(nthreads)
    x = testing.make_sparse_expanded_inputs(shape, K, dtype=dtype, seed=31, start_pos=shape.S - shape.T)
    x["q_nope"], x["q_pe"] = x["q_nope"].float(), x["q_pe"].float()
    idx = x["topk_idx"].clone()
    idx[:, -1] = -1  # a query with no key
    idx[0, 0, :1] = idx[0, 0, -1:]  # a repeated key
    x["topk_idx"] = idx
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=32)
    extra = 5 - shape.H  # heads added: [B, X, extra, D]

    def padded(t, random):
        fill = testing.randn(t.shape[:2] + (extra,) + t.shape[3:], seed=33).to(t.dtype) if random else \
            torch.zeros(t.shape[:2] + (extra,) + t.shape[3:], dtype=t.dtype)
        return torch.cat([t, fill], dim=2)

    wide = dict(x, q_nope=padded(x["q_nope"], False), q_pe=padded(x["q_pe"], False),
                k_nope=padded(x["k_nope"], True), v=padded(x["v"], True))
    packed = _native_forward_backward(x, grad_out, 0.3)
    eight_lane = _native_forward_backward(wide, padded(grad_out, False), 0.3)
    names = ("out", "lse", "d q_nope", "d q_pe", "d k_nope", "d k_pe", "d v")
    for name, got, want in zip(names, packed, eight_lane):
        want = want if name == "d k_pe" else want[:, :, :shape.H]
        assert torch.equal(got, want), name
    assert packed[1][:, -1].eq(-float("inf")).all() and not packed[0][:, -1].any()
