"""KDA's Triton kernels (the fused recurrence, the causal conv and its step) against the references, on small
shapes (under the interpreter without a GPU)."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import kda
from tests.backends.triton.helpers import assert_close, kernel

SHAPES = (testing.KDAShape(2, 9, 2, 16, 8), testing.KDAShape(1, 3, 1, 8, 40), testing.KDAShape(1, 1, 3, 12, 4))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["kda_recurrent", "kda_chunked"])
def test_recurrence_matches_reference(op, shape, dtype, device):
    """V = 40 spans two BV = 32 column blocks; K = 12 is not a power of two (masked rows)."""
    x = testing.make_kda_inputs(shape, dtype=dtype, device=device, seed=3)
    o, s = kernel(op)(**x, output_final_state=True, use_qk_l2norm=True)
    ro, rs = kda.recurrent_reference(**x, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close(o, ro, dtype, "output")
    assert_close(s, rs, torch.float32 if dtype == torch.float32 else dtype, "state")


def test_recurrence_without_state_or_l2norm(device):
    x = testing.make_kda_inputs(SHAPES[0], device=device, seed=4, initial_state=False)
    o, s = kernel("kda_recurrent")(**x, output_final_state=False, use_qk_l2norm=False, scale=0.3)
    ro, _ = kda.recurrent_reference(**x, use_qk_l2norm=False, scale=0.3)
    assert s is None
    assert_close(o, ro, torch.float32, "output")


@pytest.mark.parametrize("with_state", [True, False])
def test_conv_matches_reference(with_state, device):
    shape = testing.KDAShape(2, 19, 2, 16, 8)  # D = 96: two channel blocks, T = 19: two token blocks
    c = testing.make_conv_inputs(shape, device=device, seed=5, conv_state=with_state)
    out, state = kernel("kda_causal_conv")(**c, output_final_state=True)
    ref, ref_state = kda.causal_conv_reference(**c, output_final_state=True)
    assert_close(out, ref, torch.float32, "out")
    assert torch.equal(state, ref_state)
    step, step_state = kernel("kda_causal_conv_update")(c["x"][:, 0], ref_state, c["weight"])
    ref_step, ref_step_state = kda.causal_conv_update_reference(c["x"][:, 0], ref_state, c["weight"])
    assert_close(step, ref_step, torch.float32, "step")
    assert torch.equal(step_state, ref_step_state)


def test_kernels_decline_fp64_and_wide_heads(device):
    x = testing.make_kda_inputs(testing.KDAShape(1, 2, 1, 4, 4), dtype=torch.float64, device=device)
    ok, why = kernel("kda_recurrent").supports(**x)
    assert not ok and "fp64" in why
    wide = testing.make_kda_inputs(testing.KDAShape(1, 1, 1, 512, 4), device=device)
    ok, why = kernel("kda_chunked").supports(**wide)
    assert not ok and "K=512" in why


# ------------------------------------------------------------------------------------------------ backward
def _kda_grads(fn, x, *, l2norm=True, scale=None, through=("o", "state"), output_final_state=True):
    """(o, state, {input: grad}) of sum(o * c_o) + sum(state * c_s) (the parts named in ``through``)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
    o, s = fn(**leaves, output_final_state=output_final_state, use_qk_l2norm=l2norm, scale=scale)
    loss = 0
    if "o" in through:
        loss = loss + (o * testing.randn(o.shape, seed=31, dtype=o.dtype, device=o.device)).float().sum()
    if "state" in through:
        loss = loss + (s * testing.randn(s.shape, seed=32, dtype=s.dtype, device=s.device)).sum()
    loss.backward()
    return o, s, {k: leaves[k].grad for k in sorted(leaves)}


def _triton_kda(**launch):
    """The Triton kda_chunked with the kda family's launch, some blocks changed (small checkpoints and value blocks
    reach several checkpoints and column blocks at the interpreter's tiny sizes)."""
    import dataclasses

    from glm5_core.backends.triton import kda as triton_kda

    config = dataclasses.replace(triton_kda.DEFAULT_LAUNCH, blocks={**triton_kda.DEFAULT_LAUNCH.blocks, **launch})
    return lambda **t: triton_kda.chunked(**t, config=config)


def _check_grads(got: dict, x: dict, dtype, reference, **kwargs):
    """Each input's gradient against the reference's at ``dtype`` and in fp64 (the conformance tolerance rule)."""
    _, _, want = _kda_grads(reference, x, **kwargs)
    _, _, exact = _kda_grads(reference, {k: v.double() for k, v in x.items()}, **kwargs)
    assert sorted(got) == sorted(exact)
    for name in got:
        assert got[name].dtype == x[name].dtype, name
        if exact[name] is None:  # no path to the loss (q through the state alone): the kernel's gradient is zero
            assert want[name] is None and not got[name].any(), name
            continue
        cmp = testing.compare_to_fp64(got[name], want[name], exact[name], dtype)
        assert cmp.passed, f"d{name}: {cmp.detail}"


GRAD_SHAPES = (  # (shape, with an initial state, launch blocks)
    (testing.KDAShape(2, 5, 2, 12, 20), True, {}),  # B > 1, odd K (masked rows), two value blocks
    (testing.KDAShape(1, 1, 1, 8, 4), False, {}),  # one token, no state
    # 3 checkpoints, the last partial; odd dims; two value blocks forward and backward
    (testing.KDAShape(1, 11, 2, 5, 3), True, {"checkpoint": 4, "v": 2, "v_bwd": 2}),
    (testing.KDAShape(2, 7, 1, 3, 6), False, {"checkpoint": 2, "v_bwd": 4}),
)


@pytest.mark.parametrize("case", GRAD_SHAPES, ids=lambda c: f"{c[0]}-{'s0' if c[1] else 'nos0'}-{c[2]}")
def test_kda_gradients_match_the_reference(case, device):
    shape, with_state, blocks = case
    x = testing.make_kda_inputs(shape, device=device, seed=3, initial_state=with_state)
    _, _, got = _kda_grads(_triton_kda(**blocks), x)
    _check_grads(got, x, torch.float32, lambda **t: kda.chunked_reference(**t, chunk_size=4))


def test_kda_gradients_without_l2norm_through_one_output_each(device):
    """scale given, no L2 norm; the loss through the output alone, then through the final state alone (the other
    output's gradient is None: its zero cotangent must not be read as garbage)."""
    x = testing.make_kda_inputs(testing.KDAShape(1, 6, 2, 8, 5), device=device, seed=5)
    for through in (("o",), ("state",)):
        kw = dict(l2norm=False, scale=0.3, through=through)
        _, _, got = _kda_grads(_triton_kda(checkpoint=4), x, **kw)
        _check_grads(got, x, torch.float32, kda.recurrent_reference, **kw)
    kw = dict(through=("o",), output_final_state=False)
    _, _, got = _kda_grads(_triton_kda(), x, **kw)
    _check_grads(got, x, torch.float32, kda.recurrent_reference, **kw)


def test_kda_gradients_bf16(device):
    x = testing.make_kda_inputs(testing.KDAShape(1, 5, 1, 8, 4), dtype=torch.bfloat16, device=device, seed=7)
    _, _, got = _kda_grads(_triton_kda(), x)
    _check_grads(got, x, torch.bfloat16, kda.recurrent_reference)


def test_kda_backward_is_bitwise_repeatable_and_independent_of_the_checkpoint_interval(device):
    """No atomics: the same bits run to run; the checkpoint interval only moves memory (the segment reruns are
    the forward's operations in its order)."""
    x = testing.make_kda_inputs(testing.KDAShape(1, 6, 1, 8, 6), device=device, seed=9)
    runs = [_kda_grads(_triton_kda(checkpoint=c, v_bwd=4), x) for c in (4, 4, 1, 32)]
    for o, s, grads in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(s, runs[0][1])
        assert all(torch.equal(grads[k], runs[0][2][k]) for k in grads), "gradients differ"


def test_kda_backward_in_several_launches_gives_the_same_bits(device):
    """A scratch budget of one (batch row, head) pair a launch (5 launches) against one launch for all."""
    from glm5_core.backends.triton import kda as triton_kda
    from glm5_core.backends.triton import kda_bwd

    shape = testing.KDAShape(1, 5, 5, 6, 5)
    x = testing.make_kda_inputs(shape, device=device, seed=13)
    args = [x[k].contiguous() for k in ("q", "k", "v", "g", "beta", "initial_state")]
    d_o = testing.randn(x["v"].shape, seed=1, device=device)
    d_s = testing.randn(x["initial_state"].shape, seed=2, device=device)
    config = triton_kda.DEFAULT_LAUNCH
    assert kda_bwd.pairs_per_launch(shape.T, shape.K, shape.V, 5, config, budget=1) == 1
    assert kda_bwd.pairs_per_launch(shape.T, shape.K, shape.V, 5, config) == 5
    split, whole = (kda_bwd.recurrent_backward(*args, d_o, d_s, scale=0.4, use_qk_l2norm=True, config=config,
                                               scratch_budget=budget) for budget in (1, 1 << 30))
    assert all(torch.equal(a, b) for a, b in zip(split, whole))


@pytest.mark.parametrize("op", ["kda_chunked", "kda_recurrent"])
def test_training_calls_run_the_triton_kernel(op, device):
    """With inputs that require gradients the registry keeps the Triton kernel (differentiable): no fallback."""
    from glm5_core import registry

    x = {k: v.requires_grad_() for k, v in testing.make_kda_inputs(testing.KDAShape(1, 3, 1, 4, 4),
                                                                    device=device).items()}
    entry = kda.chunked if op == "kda_chunked" else kda.recurrent
    with registry.record_fallbacks() as declined:
        o, _ = entry(**x, backend="cuda")
        o.sum().backward()
    assert declined == [] and registry.resolve(op, "cuda").kernel.differentiable
    assert "_Recurrence" in type(o.grad_fn).__name__
    assert all(x[k].grad is not None for k in x)


CONV_GRAD_CASES = (  # (shape, conv state, bias, activation)
    (testing.KDAShape(2, 19, 2, 16, 8), True, True, "silu"),  # two token and two channel blocks
    (testing.KDAShape(1, 1, 1, 5, 8), True, False, None),  # one token: every tap but one reads the state
    (testing.KDAShape(1, 2, 1, 3, 8), False, True, "silu"),  # T < W - 1
    (testing.KDAShape(1, 5, 1, 3, 8, W=1), False, True, "silu"),  # no state at all
)


@pytest.mark.parametrize("case", CONV_GRAD_CASES, ids=lambda c: f"{c[0]}W{c[0].W}-{c[1]}-{c[2]}-{c[3]}")
def test_conv_gradients_match_the_reference(case, device):
    shape, with_state, with_bias, activation = case
    c = testing.make_conv_inputs(shape, device=device, seed=5, conv_state=with_state)
    if with_bias:
        c["bias"] = testing.randn((c["x"].shape[-1],), seed=9, device=device)

    def grads(fn, inputs):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        out, state = fn(**leaves, activation=activation, output_final_state=True)
        loss = (out * testing.randn(out.shape, seed=1, dtype=out.dtype, device=out.device)).sum()
        (loss + (state * testing.randn(state.shape, seed=2, dtype=state.dtype, device=state.device)).sum()).backward()
        return {k: leaves[k].grad for k in sorted(leaves)}

    got = grads(kernel("kda_causal_conv"), c)
    want = grads(kda.causal_conv_reference, c)
    exact = grads(kda.causal_conv_reference, {k: v.double() for k, v in c.items()})
    assert sorted(got) == sorted(exact)
    for name in got:
        cmp = testing.compare_to_fp64(got[name], want[name], exact[name], torch.float32)
        assert cmp.passed, f"d{name}: {cmp.detail}"
    again = grads(kernel("kda_causal_conv"), c)
    assert all(torch.equal(got[k], again[k]) for k in got)
