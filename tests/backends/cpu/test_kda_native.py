"""The native cpu KDA decode-path kernels (glm5_core/backends/cpu/kda_native.py, csrc/cpu_kda.cpp): kda_recurrent,
kda_causal_conv, kda_causal_conv_update against the references over odd shapes and dtypes, strided inputs, the
lower-bound gate, bitwise determinism across runs and thread counts, the arguments left untouched, the kernel table,
and the conv's native backward (against autograd through the reference, gradcheck, thread counts)."""
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


def _conv_grads(fn, c, act):
    leaves = {k: v.clone().requires_grad_() for k, v in c.items()}
    out, state = fn(**leaves, activation=act, output_final_state=True)
    weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
    (out.float() * weights).sum().add(state.float().sum() * 0.3).backward()
    return [leaves[k].grad for k in sorted(leaves)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_gradients_equal_the_reference(native, dtype):
    """The native backward (through the output and the new state) against autograd through the reference: every
    input's gradient, in the input's dtype, with and without a state / bias / activation."""
    for seed, (shape, state, bias, act) in enumerate(((Shape(2, 9, 2, 11, 4, W=3), True, True, "silu"),
                                                      (Shape(2, 6, 1, 4, 4), False, True, "silu"),
                                                      (Shape(2, 2, 1, 5, 3), True, False, None),
                                                      (Shape(1, 1, 1, 1, 1), True, True, "silu"))):
        c = _conv_inputs(shape, dtype, seed, state, bias)
        with registry.record_reference_runs() as runs:
            got = _conv_grads(lambda **t: kda.causal_conv(**t, backend="cpu"), c, act)
        assert runs == []  # the native kernel took the call that needs gradients
        want = _conv_grads(kda.causal_conv_reference, c, act)
        exact = _conv_grads(kda.causal_conv_reference, _fp64(c), act)
        _check(got, want, exact, dtype)


def test_conv_gradcheck(native):
    c = _conv_inputs(Shape(1, 5, 1, 2, 2), torch.float64, 12, True, True)
    names = ("x", "weight", "bias", "conv_state")

    def fn(*t):
        args = dict(zip(names, t))
        return kda.causal_conv(**args, output_final_state=True, backend="cpu")

    assert torch.autograd.gradcheck(fn, tuple(c[k].clone().requires_grad_() for k in names))


def test_conv_gradients_bitwise_across_thread_counts(native, threads):
    c = _conv_inputs(Shape(2, 7, 3, 40, 4), torch.float32, 13, True, True)  # D = 360: several channel blocks
    torch.set_num_threads(1)
    base = _conv_grads(lambda **t: kda.causal_conv(**t, backend="cpu"), c, "silu")
    for n in (2, 3):
        torch.set_num_threads(n)
        again = _conv_grads(lambda **t: kda.causal_conv(**t, backend="cpu"), c, "silu")
        assert all(torch.equal(a, b) for a, b in zip(base, again)), n


def test_fake_impls_trace_shapes(native):
    """The meta implementations give each op's output shapes and dtypes (torch.compile / FakeTensor tracing)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.glm5_cpu
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 3, 4, 5, dtype=torch.bfloat16)
        o, s = ops.kda_recurrent(q, q, torch.empty(2, 3, 4, 7, dtype=torch.bfloat16), torch.empty(2, 3, 4, 5),
                                 torch.empty(2, 3, 4), None, 0.5, True)
        x, w, st = torch.empty(2, 6, 9, dtype=torch.bfloat16), torch.empty(9, 4), torch.empty(2, 3, 9)
        out, new = ops.kda_causal_conv(x, w, None, st, True)
        dx, dw, db, ds = ops.kda_causal_conv_backward(out, new, x, w, None, st, True)
    assert (o.shape, o.dtype, s.shape, s.dtype) == ((2, 3, 4, 7), torch.bfloat16, (2, 4, 5, 7), torch.float32)
    assert (out.shape, out.dtype, new.shape, new.dtype) == ((2, 6, 9), torch.bfloat16, (2, 3, 9), torch.float32)
    assert (dx.shape, dx.dtype, dw.shape, db.shape, ds.shape) == ((2, 6, 9), torch.bfloat16, (9, 4), (0,), (2, 3, 9))
