"""cpu ``mla_prefill`` through torch's fused CPU attention vs the reference (judged against an fp64 reference run):
T = 1, S = 1, T != S, int and ragged [B] start_pos, H = 1, odd head dims, values wider and narrower than the
query-key width, fp32 / bf16 / fp64, forward and every input gradient; the flash kernel (not torch's unfused math
path) runs forward and backward; bitwise repeatable backward across runs and thread counts; the registry routes
training calls to it, with or without the C++ extension. Needs no extension: no ``native`` fixture."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends.cpu import mla as native_mla
from glm5_core.ops import mla

MLAShape = testing.MLAShape
CASES = (
    (MLAShape(B=1, T=1, S=1, H=1, Dn=8, Dr=4, Dv=8, C=16), "first"),  # T = S = 1
    (MLAShape(B=2, T=1, S=9, H=3, Dn=8, Dr=4, Dv=8, C=16), "last"),  # one decode-like query at the end
    (MLAShape(B=2, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24), "first"),  # T < S from slot 0: sdpa's own mask
    (MLAShape(B=3, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24), "ragged"),  # a [B] start_pos tensor
    (MLAShape(B=2, T=7, S=11, H=1, Dn=5, Dr=3, Dv=7, C=13), "last"),  # H = 1, odd sizes
    (MLAShape(B=2, T=6, S=6, H=2, Dn=4, Dr=2, Dv=11, C=9), "first"),  # values wider than the query-key width
    (MLAShape(B=2, T=33, S=33, H=4, Dn=32, Dr=16, Dv=32, C=128), "first"),  # the benchmark's head dims
    (MLAShape(B=2, T=70, S=150, H=2, Dn=16, Dr=16, Dv=32, C=40), "ragged"),  # several kernel blocks, equal widths
)
DIFFERENTIABLE = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")
SCALE = 0.3


def _run(fn, inputs, start_pos, grad_out):
    """fn's output and the gradient of every input, backpropagated with ``grad_out``."""
    leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in DIFFERENTIABLE}
    out = fn(**leaves, scale=SCALE, start_pos=start_pos)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), {n: leaves[n].grad for n in DIFFERENTIABLE}


def _case_inputs(shape, mode, dtype, seed):
    inputs = testing.make_mla_inputs(shape, dtype=dtype, seed=seed)
    start_pos = testing.start_positions_for(shape.B, shape.T, shape.S, mode)
    grad_out = testing.randn((shape.B, shape.T, shape.H, shape.Dv), seed=seed + 10)
    return inputs, start_pos, grad_out


@pytest.mark.parametrize("shape,mode", CASES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_forward_and_gradients_match_the_reference(shape, mode, dtype):
    inputs, start_pos, grad_out = _case_inputs(shape, mode, dtype, seed=3)
    out, got = _run(native_mla.prefill, inputs, start_pos, grad_out)
    ref_out, same_precision = _run(mla.prefill_reference, inputs, start_pos, grad_out)
    exact_inputs = {n: t.double() for n, t in inputs.items()}
    exact_out, exact = _run(mla.prefill_reference, exact_inputs, start_pos, grad_out.double())
    verdict = testing.compare_to_fp64(out, ref_out, exact_out, dtype)
    assert verdict.passed, f"out: {verdict.detail}"
    for name in DIFFERENTIABLE:
        assert got[name].shape == inputs[name].shape
        verdict = testing.compare_to_fp64(got[name], same_precision[name], exact[name], dtype)
        assert verdict.passed, f"{name}: {verdict.detail}"


def test_views_of_one_kv_b_proj_weight_give_the_same_results():
    """w_uk and w_uv as the two halves of kv_b_proj's weight viewed [H, Dn + Dv, C] (what the model passes)."""
    shape, mode = CASES[3]
    inputs, start_pos, grad_out = _case_inputs(shape, mode, torch.float32, seed=4)
    w = torch.cat([inputs["w_uk"], inputs["w_uv"]], dim=1)  # [H, Dn + Dv, C]
    views = dict(inputs, w_uk=w[:, :shape.Dn], w_uv=w[:, shape.Dn:])
    assert not views["w_uk"].is_contiguous()
    out, got = _run(native_mla.prefill, inputs, start_pos, grad_out)
    out_v, got_v = _run(native_mla.prefill, views, start_pos, grad_out)
    assert torch.equal(out, out_v) and all(torch.equal(got[n], got_v[n]) for n in DIFFERENTIABLE)


@pytest.mark.parametrize("mode", ("first", "last", "ragged"))
def test_torch_runs_its_fused_flash_kernel_not_the_math_path(mode):
    """sdpa's CPU flash kernel needs one head width: without the zero padding torch silently takes its unfused
    math path (Dn + Dr = 48 against Dv = 32 here)."""
    shape = MLAShape(B=2, T=8, S=12, H=2, Dn=32, Dr=16, Dv=32, C=24)
    inputs, start_pos, grad_out = _case_inputs(shape, mode, torch.float32, seed=5)
    with torch.profiler.profile() as prof:
        _run(native_mla.prefill, inputs, start_pos, grad_out)
    ran = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ran, sorted(ran)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ran, sorted(ran)
    assert "aten::_scaled_dot_product_attention_math" not in ran


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("mode", ("first", "ragged"))
def test_backward_is_bitwise_repeatable_across_runs_and_thread_counts(threads, dtype, mode):
    """1 and 2 threads (this machine's cores). torch's flash kernel splits its work by (batch, head, query block)
    whatever the thread count; the key-expansion GEMM's backward is MKL's, which at 3 threads (oversubscribed here)
    sums d c_kv in another order: so does the reference's."""
    shape = MLAShape(B=2, T=70, S=150, H=3, Dn=16, Dr=8, Dv=16, C=40)
    inputs, start_pos, grad_out = _case_inputs(shape, mode, dtype, seed=6)
    results = []
    for n in (1, 2, 1, 2):
        torch.set_num_threads(n)
        results.append(_run(native_mla.prefill, inputs, start_pos, grad_out))
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        assert torch.equal(out0, out) and all(torch.equal(grads0[n], grads[n]) for n in DIFFERENTIABLE)


def test_gradcheck_fp64(threads):
    torch.set_num_threads(1)  # some thousand tiny calls
    shape = MLAShape(B=2, T=3, S=5, H=2, Dn=3, Dr=2, Dv=4, C=4)
    inputs = testing.make_mla_inputs(shape, dtype=torch.float64, seed=7)
    leaves = [inputs[n].requires_grad_(True) for n in DIFFERENTIABLE]
    start_pos = torch.tensor([0, 2])
    assert torch.autograd.gradcheck(lambda *a: native_mla.prefill(*a, scale=0.4, start_pos=start_pos), leaves,
                                    eps=1e-6, atol=1e-7)


def test_training_calls_take_the_cpu_kernel():
    shape, mode = CASES[3]
    inputs, start_pos, _ = _case_inputs(shape, mode, torch.float32, seed=8)
    leaves = {n: inputs[n].requires_grad_(True) for n in DIFFERENTIABLE}
    assert registry.resolve("mla_prefill", "cpu").label == "cpu: glm5_core.backends.cpu.mla.prefill"
    with registry.record_reference_runs() as ran:
        out = mla.prefill(**leaves, scale=SCALE, start_pos=start_pos, backend="cpu")
    assert ran == [] and out.grad_fn is not None
    out.sum().backward()
    assert all(leaf.grad is not None for leaf in leaves.values())


def test_entry_point_still_names_the_bad_argument():
    inputs, _, _ = _case_inputs(*CASES[2], torch.float32, seed=9)
    with pytest.raises(ValueError, match="start_pos"):
        mla.prefill(**inputs, scale=SCALE, start_pos=20, backend="cpu")
    with pytest.raises(ValueError, match="w_uv: expected"):
        mla.prefill(**dict(inputs, w_uv=inputs["w_uv"][:, :, 1:]), scale=SCALE, backend="cpu")
