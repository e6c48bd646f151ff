"""The native cpu KDA decode-path kernels (glm5_core/backends/cpu/kda_native.py, csrc/cpu_kda.cpp): kda_recurrent,
kda_causal_conv, kda_causal_conv_update against the references over odd shapes and dtypes, strided inputs, the
lower-bound gate, bitwise determinism across runs and thread counts, the arguments left untouched, the kernel table
and the gradient route of the conv."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends.cpu import backend
from glm5_core.ops import kda

Shape = testing.KDAShape
# T = 1 (decode), odd H / K / V (not a multiple of any vector width), B > 1, V wider than one column block
RECURRENT_SHAPES = (Shape(1, 1, 1, 1, 1), Shape(3, 1, 5, 7, 9), Shape(2, 1, 4, 64, 64), Shape(2, 5, 3, 33, 129),
                    Shape(1, 3, 2, 16, 17))
CONV_SHAPES = (Shape(1, 1, 1, 1, 1, W=4), Shape(3, 1, 5, 7, 9, W=4), Shape(2, 9, 2, 11, 4, W=3),
               Shape(2, 2, 1, 5, 3, W=4), Shape(2, 3, 1, 300, 1, W=1))
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _fp64(x):
    return {k: v.to(torch.float64) for k, v in x.items()}


def _check(got, want, exact, dtype):
    for g, w, e in zip(got, want, exact):
        cmp = testing.compare_to_fp64(g, w, e, dtype)
        assert cmp.passed, cmp.detail


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", RECURRENT_SHAPES, ids=str)
def test_recurrent_matches_the_reference(native, shape, dtype):
    for seed, (init, l2norm) in enumerate(((True, True), (False, True), (True, False))):
        x = testing.make_kda_inputs(shape, dtype=dtype, seed=seed, initial_state=init)
        kw = {"output_final_state": True, "use_qk_l2norm": l2norm}
        got = kda.recurrent(**x, backend="cpu", **kw)
        _check(got, kda.recurrent_reference(**x, **kw), kda.recurrent_reference(**_fp64(x), **kw), dtype)
    assert kda.recurrent(**x, backend="cpu")[1] is None  # no state asked for


@pytest.mark.parametrize("gate", [testing.KDA_LOWER_BOUND, 0.0], ids=["lower_bound", "no_decay"])
def test_recurrent_at_the_gate_bounds(native, gate):
    """g at GLM-5.3's lower bound (the strongest decay) everywhere, and g = 0 (no decay), from a state."""
    x = testing.make_kda_inputs(Shape(2, 3, 3, 16, 24), seed=4)
    x["g"] = torch.full_like(x["g"], gate)
    kw = {"output_final_state": True, "use_qk_l2norm": True}
    _check(kda.recurrent(**x, backend="cpu", **kw), kda.recurrent_reference(**x, **kw),
           kda.recurrent_reference(**_fp64(x), **kw), torch.float32)


def test_recurrent_strided_inputs_and_scale(native):
    """q, k, v as slices of one projection (the model's layout), g / beta in bf16, an explicit scale."""
    B, T, H, K = 2, 2, 3, 8
    mixed = torch.randn(B, T, 3 * H * K, dtype=torch.bfloat16)
    q, k, v = (t.reshape(B, T, H, K) for t in mixed.split(H * K, dim=-1))
    x = testing.make_kda_inputs(Shape(B, T, H, K, K), dtype=torch.bfloat16, seed=5)
    x.update(q=q, k=k, v=v)
    kw = {"output_final_state": True, "use_qk_l2norm": True, "scale": 0.3}
    _check(kda.recurrent(**x, backend="cpu", **kw), kda.recurrent_reference(**x, **kw),
           kda.recurrent_reference(**_fp64(x), **kw), torch.bfloat16)


def _conv_inputs(shape, dtype, seed, state, bias):
    c = testing.make_conv_inputs(shape, dtype=dtype, seed=seed, conv_state=state)
    if bias:
        c["bias"] = testing.randn((c["weight"].shape[0],), seed=seed + 7, dtype=dtype)
    return c


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=lambda s: f"{s}W{s.W}")
def test_conv_and_update_match_the_reference(native, shape, dtype):
    for seed, (state, bias, act) in enumerate(((True, False, "silu"), (False, True, "silu"), (True, True, None))):
        c = _conv_inputs(shape, dtype, seed, state, bias)
        got = kda.causal_conv(**c, activation=act, output_final_state=True, backend="cpu")
        want = kda.causal_conv_reference(**c, activation=act, output_final_state=True)
        _check(got, want, kda.causal_conv_reference(**_fp64(c), activation=act, output_final_state=True), dtype)
        assert torch.equal(got[1], want[1])  # the new state is a copy of inputs: exact
        if act is None:  # the taps are summed as the reference sums them: the same bits
            assert torch.equal(got[0], want[0])
        if state:
            step = {**c, "x": c["x"][:, 0]}
            got = kda.causal_conv_update(**step, activation=act, backend="cpu")
            want = kda.causal_conv_update_reference(**step, activation=act)
            _check(got, want, kda.causal_conv_update_reference(**_fp64(step), activation=act), dtype)
            assert torch.equal(got[1], want[1])


def test_conv_silu_over_a_wide_range(native):
    """Pre-activations from -100 to 100 (SiLU's polynomial exp clamps; nothing overflows to nan)."""
    x = torch.linspace(-100.0, 100.0, 4001).reshape(1, 1, -1)
    weight = torch.zeros(x.shape[-1], 2)
    weight[:, 1] = 1.0
    got, _ = kda.causal_conv(x, weight, backend="cpu")
    want, _ = kda.causal_conv_reference(x, weight)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)


def _decode_outputs():
    x = testing.make_kda_inputs(Shape(3, 2, 5, 24, 40), seed=8)
    c = testing.make_conv_inputs(Shape(3, 5, 5, 24, 40), seed=8)
    return [*kda.recurrent(**x, output_final_state=True, use_qk_l2norm=True, backend="cpu"),
            *kda.causal_conv(**c, output_final_state=True, backend="cpu"),
            *kda.causal_conv_update(c["x"][:, 0], c["conv_state"], c["weight"], backend="cpu")]


def test_bitwise_across_runs_and_thread_counts(native, threads):
    torch.set_num_threads(1)
    base = _decode_outputs()
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        assert all(torch.equal(a, b) for a, b in zip(base, _decode_outputs())), n


def test_arguments_are_not_modified(native):
    x = testing.make_kda_inputs(Shape(2, 1, 2, 8, 8), seed=9)
    c = testing.make_conv_inputs(Shape(2, 1, 2, 8, 8), seed=9)
    before = {k: v.clone() for k, v in {**x, **c}.items()}
    kda.recurrent(**x, output_final_state=True, backend="cpu")
    kda.causal_conv_update(c["x"][:, 0], c["conv_state"], c["weight"], backend="cpu")
    assert all(torch.equal(before[k], v) for k, v in {**x, **c}.items())


def test_native_kernels_are_in_the_table(native):
    for op in ("kda_recurrent", "kda_causal_conv", "kda_causal_conv_update"):
        res = registry.resolve(op, "cpu")
        assert res.kernel is not None and "kda_native" in res.label, res.label
        assert op not in backend.REFERENCE_BY_CHOICE


def test_conv_needing_gradients_runs_the_reference(native):
    """kda_causal_conv's native kernel is forward only: a call with gradients runs the differentiable reference,
    and its gradients are the reference's."""
    c = testing.make_conv_inputs(Shape(2, 6, 1, 4, 4), seed=10)
    leaves = {k: v.clone().requires_grad_() for k, v in c.items()}
    with registry.record_reference_runs() as runs:
        out, state = kda.causal_conv(**leaves, output_final_state=True, backend="cpu")
    assert [op for op, _ in runs] == ["kda_causal_conv"]
    (out.square().sum() + state.sum()).backward()
    ref = {k: v.clone().requires_grad_() for k, v in c.items()}
    r_out, r_state = kda.causal_conv_reference(**ref, output_final_state=True)
    (r_out.square().sum() + r_state.sum()).backward()
    assert all(torch.equal(leaves[k].grad, ref[k].grad) for k in c)
