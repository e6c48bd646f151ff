"""Native backward of sparse MLA prefill vs the reference's autograd (judged against an fp64 reference run):
odd shapes, K = 1, -1-padded indices, a query with no key, bf16 keys; bitwise repeatable; the custom op
through ``opcheck``; the registry routes training calls to it."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends.cpu import dsa as native_dsa
from glm5_core.ops import dsa
from tests.backends.cpu.sparse_grads import as_fp64, grads

SHAPES = (
    (testing.MLAShape(B=1, T=1, S=1, H=1, Dn=8, Dr=4, Dv=8, C=16), 1),  # K = 1, the only row has no key
    (testing.MLAShape(B=2, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24), 1),  # K = 1
    (testing.MLAShape(B=2, T=7, S=11, H=3, Dn=5, Dr=3, Dv=7, C=13), 4),  # odd sizes, early rows -1 padded
    (testing.MLAShape(B=1, T=9, S=9, H=2, Dn=8, Dr=4, Dv=6, C=10), 20),  # K > S: -1 padding everywhere
    (testing.MLAShape(B=2, T=3, S=300, H=5, Dn=16, Dr=8, Dv=12, C=37), 200),  # more than one 128-key chunk
)
DIFFERENTIABLE = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")


def _grads(fn, inputs, grad_out, scale=0.3):
    return grads(fn, inputs, grad_out, DIFFERENTIABLE, scale=scale)


@pytest.mark.parametrize("shape,K", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_gradients_match_the_reference(native, shape, K, dtype):
    inputs = testing.make_sparse_inputs(shape, K, dtype=dtype, seed=5)
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=6)
    out, got = _grads(native_dsa.sparse_prefill, inputs, grad_out)
    _, same_precision = _grads(dsa.sparse_attention_reference, inputs, grad_out)
    _, exact = _grads(dsa.sparse_attention_reference, as_fp64(inputs), grad_out.double())
    for name in DIFFERENTIABLE:
        verdict = testing.compare_to_fp64(got[name], same_precision[name], exact[name], dtype)
        assert verdict.passed, f"{name}: {verdict.detail}"
    assert torch.equal(got["q_nope"][0, 0], torch.zeros_like(got["q_nope"][0, 0]))  # the query with no key


def test_keys_never_selected_get_zero_gradient(native):
    shape, K = SHAPES[4]
    inputs = testing.make_sparse_inputs(shape, K, seed=7)
    inputs["topk_idx"] = inputs["topk_idx"].clamp(max=150)  # keys 151.. are never selected
    _, got = _grads(native_dsa.sparse_prefill, inputs, testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=8))
    assert not got["c_kv"][:, 151:].any() and not got["k_pe"][:, 151:].any() and got["c_kv"][:, :151].any()


def test_gradcheck_fp64(native, threads):
    torch.set_num_threads(1)  # some thousand tiny calls
    shape, K = testing.MLAShape(B=1, T=3, S=4, H=2, Dn=3, Dr=2, Dv=3, C=4), 2
    inputs = as_fp64(testing.make_sparse_inputs(shape, K, seed=9, start_pos=1))
    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in DIFFERENTIABLE]
    idx = inputs["topk_idx"]
    assert torch.autograd.gradcheck(lambda *a: native_dsa.sparse_prefill(*a, idx, scale=0.4), leaves,
                                    eps=1e-6, atol=1e-7)


def test_backward_is_bitwise_repeatable_across_runs_and_thread_counts(native, threads):
    shape, K = SHAPES[4]
    inputs = testing.make_sparse_inputs(shape, K, seed=10)
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=11)
    q_lat = testing.randn((shape.B, shape.T, shape.H, shape.C), seed=12)
    core = (q_lat, inputs["q_pe"], inputs["c_kv"], inputs["k_pe"], inputs["topk_idx"], 0.3)
    d_out = testing.randn((shape.B, shape.T, shape.H, shape.C), seed=13)
    results = []
    for n in (1, 2, 3, 2):
        torch.set_num_threads(n)
        results.append(torch.ops.glm5_cpu.sparse_prefill_backward(d_out, *core))
        _, grads = _grads(native_dsa.sparse_prefill, inputs, grad_out)
        results.append(tuple(grads.values()))
    for a, b in zip(results[0::2], results[2::2]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for a, b in zip(results[1::2], results[3::2]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_custom_op_passes_opcheck(native, dtype):
    shape, K = SHAPES[2]
    inputs = testing.make_sparse_inputs(shape, K, dtype=dtype, seed=14)
    q_lat = testing.randn((shape.B, shape.T, shape.H, shape.C), seed=15)
    d_out = testing.randn((shape.B, shape.T, shape.H, shape.C), seed=16)
    torch.library.opcheck(torch.ops.glm5_cpu.sparse_prefill_backward,
                          (d_out, q_lat, inputs["q_pe"].float(), inputs["c_kv"], inputs["k_pe"], inputs["topk_idx"],
                           0.3))


def test_backward_rejects_an_index_past_the_keys(native):
    shape, K = SHAPES[2]
    inputs = testing.make_sparse_inputs(shape, K, seed=17)
    q_lat = testing.randn((shape.B, shape.T, shape.H, shape.C), seed=18)
    bad = inputs["topk_idx"].clone()
    bad[1, 3, 0] = shape.S
    with pytest.raises(IndexError, match="past the keys"):
        torch.ops.glm5_cpu.sparse_prefill_backward(torch.ones_like(q_lat), q_lat, inputs["q_pe"], inputs["c_kv"],
                                                   inputs["k_pe"], bad, 0.3)


def test_training_calls_take_the_native_kernel(native):
    shape, K = SHAPES[2]
    inputs = testing.make_sparse_inputs(shape, K, seed=19)
    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in DIFFERENTIABLE]
    with registry.record_reference_runs() as ran:
        out = dsa.sparse_prefill(*leaves, inputs["topk_idx"], scale=0.3, backend="cpu")
    assert ran == [] and out.grad_fn is not None
    out.sum().backward()
    assert all(leaf.grad is not None for leaf in leaves)
