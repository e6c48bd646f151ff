"""Native backward of the fused MoE experts vs the reference's autograd: gradients to the tokens, the routing
weights and the three expert weight stacks; bitwise repeatable; the custom ops through ``opcheck``."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends.cpu import moe as native_moe
from glm5_core.ops import moe

SHAPES = testing.MOE_SHAPES + (testing.MoEShape(N=301, E=64, K=8, G=1, TG=1, D=40, F=8),
                               testing.MoEShape(N=50, E=9, K=9, G=1, TG=1, D=7, F=3),
                               testing.MoEShape(N=23, E=5, K=1, G=1, TG=1, D=13, F=6))
GRAD_NAMES = ("x", "weights", "w_gate", "w_up", "w_down")


def _case(shape, dtype, seed=11, repeats=True):
    """(x, weights, ids, w_gate, w_up, w_down, grad_out): a crowded expert 0, the last expert never picked
    (no token), and, with ``repeats``, tokens that pick the same expert in two slots (the contract allows it)."""
    ids = torch.randint(0, max(1, shape.E - 1), (shape.N, shape.K), generator=testing.generator(seed))
    ids[: shape.N // 2, 0] = 0
    if repeats and shape.K > 1:
        ids[::3, 1] = ids[::3, 0]
    w = testing.make_expert_inputs(shape, dtype=dtype, seed=seed + 1)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # route's output dtype
    weights = testing.randn((shape.N, shape.K), seed=seed + 2, dtype=weight_dtype)
    grad_out = testing.randn((shape.N, shape.D), seed=seed + 3, dtype=dtype)
    return (w["x"], weights, ids.to(torch.int32), w["w_gate"], w["w_up"], w["w_down"]), grad_out


def _grads(fn, args, grad_out, dtype=None):
    """(out, grads in GRAD_NAMES order) of fn over leaf copies of args (cast to ``dtype`` when given)."""
    x, weights, ids, wg, wu, wd = args
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    leaves = [cast(t).detach().clone().requires_grad_(True) for t in (x, weights, wg, wu, wd)]
    out = fn(leaves[0], leaves[1], ids, *leaves[2:])
    out.backward(cast(grad_out))
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_gradients_match_reference_autograd(native, shape, dtype):
    args, grad_out = _case(shape, dtype)
    out, grads = _grads(native_moe.fused_experts, args, grad_out)
    out_ref, grads_ref = _grads(moe.fused_experts_reference, args, grad_out)
    assert torch.equal(out, native_moe.fused_experts(*args))  # the training forward is the inference forward
    atol, rtol = testing.TOLERANCES[dtype]
    for name, got, want in zip(GRAD_NAMES, grads, grads_ref):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")
    for got in grads[2:]:  # the expert nobody picked
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=str)
def test_bf16_gradients_as_close_to_fp64_as_the_reference(native, shape):
    args, grad_out = _case(shape, torch.bfloat16)
    _, grads = _grads(native_moe.fused_experts, args, grad_out)
    _, grads_ref = _grads(moe.fused_experts_reference, args, grad_out)
    _, grads_exact = _grads(moe.fused_experts_reference, args, grad_out, dtype=torch.float64)
    for name, got, ref, exact in zip(GRAD_NAMES, grads, grads_ref, grads_exact):
        result = testing.compare_to_fp64(got, ref, exact, torch.bfloat16)
        assert result.passed, f"{name}: {result.detail}"


def test_all_rows_in_one_expert_and_every_expert_empty_but_one(native):
    shape = SHAPES[1]
    args, grad_out = _case(shape, torch.float64, repeats=False)
    ids = torch.full_like(args[2], 3)  # every slot of every token on expert 3
    args = args[:2] + (ids,) + args[3:]
    _, grads = _grads(native_moe.fused_experts, args, grad_out)
    _, grads_ref = _grads(moe.fused_experts_reference, args, grad_out)
    for name, got, want in zip(GRAD_NAMES, grads, grads_ref):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    others = [e for e in range(shape.E) if e != 3]
    for got in grads[2:]:
        assert not got[others].any()


def test_backward_bitwise_repeatable_and_thread_invariant(native, threads):
    shape = SHAPES[3]
    args, grad_out = _case(shape, torch.float32)
    runs = []
    for n in (2, 2, 1):
        torch.set_num_threads(n)
        runs.append(_grads(native_moe.fused_experts, args, grad_out)[1])
    for name, a, b, c in zip(GRAD_NAMES, *runs):
        assert torch.equal(a, b), f"{name}: two runs differ"
        assert torch.equal(a, c), f"{name}: one thread and two differ"  # one thread per expert


def test_only_the_needed_gradients_are_returned(native):
    args, grad_out = _case(SHAPES[1], torch.float32)
    x, weights, ids, wg, wu, wd = args
    x = x.clone().requires_grad_(True)
    out = native_moe.fused_experts(x, weights, ids, wg, wu, wd)
    out.backward(grad_out)
    _, grads_ref = _grads(moe.fused_experts_reference, args, grad_out)
    torch.testing.assert_close(x.grad, grads_ref[0], atol=2e-5, rtol=1e-4)
    assert weights.grad is None and wg.grad is None


def test_gradcheck_fp64(native):
    shape = testing.MoEShape(N=5, E=4, K=2, G=1, TG=1, D=3, F=2)
    args, _ = _case(shape, torch.float64)
    x, weights, ids, wg, wu, wd = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in args)
    assert torch.autograd.gradcheck(lambda *a: native_moe.fused_experts(a[0], a[1], ids, *a[2:]),
                                    (x, weights, wg, wu, wd), eps=1e-6, atol=1e-7)


def test_registry_routes_gradient_calls_to_the_native_kernel(native):
    args, grad_out = _case(SHAPES[2], torch.float32)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in args]
    assert registry.resolve("moe_fused_experts", backend="cpu").impl.fn is native_moe.fused_experts
    with registry.record_fallbacks() as fallbacks:
        out = moe.fused_experts(*leaves, backend="cpu")
    assert fallbacks == [] and out.grad_fn is not None and "FusedExperts" in type(out.grad_fn).__name__


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_custom_ops_pass_opcheck(native, dtype):
    args, grad_out = _case(SHAPES[1], dtype)
    train = torch.ops.glm5_cpu.moe_fused_experts_train
    torch.library.opcheck(train, args)
    out, gate, up, sort_idx, counts = train(*args)
    x, weights, ids, wg, wu, wd = args
    torch.library.opcheck(torch.ops.glm5_cpu.moe_fused_experts_backward,
                          (grad_out, x, weights, sort_idx, counts, gate, up, wg, wu, wd))


def test_backward_rejects_saved_tensors_of_another_shape(native):
    args, grad_out = _case(SHAPES[1], torch.float32)
    out, gate, up, sort_idx, counts = torch.ops.glm5_cpu.moe_fused_experts_train(*args)
    x, weights, ids, wg, wu, wd = args
    with pytest.raises(RuntimeError, match="gate and up"):
        torch.ops.glm5_cpu.moe_fused_experts_backward(grad_out, x, weights, sort_idx, counts, gate[:-1], up[:-1],
                                                      wg, wu, wd)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16), ids=str)
def test_dispatch_and_combine_gradients_match_reference(native, shape, dtype):
    args, grad_out = _case(shape, dtype)
    x, weights, ids = args[:3]
    y_sorted = testing.randn((shape.N * shape.K, shape.D), seed=40, dtype=dtype)

    def layer(dispatch, combine, x, y_sorted, weights):
        x_sorted, sort_idx, _ = dispatch(x, ids, num_experts=shape.E)
        return combine(x_sorted * y_sorted, sort_idx, weights)  # [N, D]

    runs = []
    for dispatch, combine in ((native_moe.dispatch, native_moe.combine),
                              (moe.dispatch_reference, moe.combine_reference)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, y_sorted, weights)]
        layer(dispatch, combine, *leaves).backward(grad_out)
        runs.append([t.grad for t in leaves])
    atol, rtol = testing.TOLERANCES[dtype]
    for name, got, want in zip(("x", "y_sorted", "weights"), *runs):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, atol=atol * 4, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


def test_dispatch_and_combine_gradcheck_fp64(native):
    shape = testing.MoEShape(N=4, E=3, K=2, G=1, TG=1, D=3, F=2)
    args, _ = _case(shape, torch.float64)
    x, weights, ids = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in args[:3])
    y_sorted = testing.randn((shape.N * shape.K, shape.D), seed=41, dtype=torch.float64).requires_grad_(True)

    def layer(x, y_sorted, weights):
        x_sorted, sort_idx, _ = native_moe.dispatch(x, ids, num_experts=shape.E)
        return native_moe.combine(x_sorted * y_sorted, sort_idx, weights)

    assert torch.autograd.gradcheck(layer, (x, y_sorted, weights), eps=1e-6, atol=1e-7)
