"""KDA ops (glm5_core.ops.kda): the references against transformers' own functions (transformers 5.25
``models/glm5_next/modeling_glm5_next.py``: recurrent_kimi_delta_attention, chunk_kimi_delta_attention,
causal_conv1d_fn, causal_conv1d_update), chunked vs recurrent, prefill then decode, odd shapes, gradients,
determinism, the cpu kernel, argument errors."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.ops import kda

M = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

SHAPES = testing.KDA_SHAPES
FP32_ATOL, _ = testing.TOLERANCES[torch.float32]


def _hf_kda(fn, x, **kw):
    """transformers' KDA function on our inputs (it computes in fp32 and returns the state in fp32)."""
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    return fn(q, k, v, g, beta, initial_state=x.get("initial_state"), output_final_state=True, **kw)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw_qk"])
def test_references_match_transformers(shape, l2norm):
    """fp32: ours and transformers' (both recurrent and chunked) within the tolerance table of the fp64 reference."""
    x = testing.make_kda_inputs(shape, seed=1)
    exact = kda.recurrent_reference(**_fp64(x), output_final_state=True, use_qk_l2norm=l2norm)
    theirs = {"recurrent": _hf_kda(M.recurrent_kimi_delta_attention, x, use_qk_l2norm_in_kernel=l2norm),
              "chunked": _hf_kda(M.chunk_kimi_delta_attention, x, chunk_size=shape.C, use_qk_l2norm_in_kernel=l2norm)}
    ours = {"recurrent": kda.recurrent_reference(**x, output_final_state=True, use_qk_l2norm=l2norm),
            "chunked": kda.chunked_reference(**x, output_final_state=True, chunk_size=shape.C, use_qk_l2norm=l2norm)}
    scale = max(1.0, float(exact[0].abs().max()), float(exact[1].abs().max()))
    for form in ("recurrent", "chunked"):
        for i, what in enumerate(("output", "state")):
            err_ours = float((ours[form][i].double() - exact[i]).abs().max())
            err_theirs = float((theirs[form][i].double() - exact[i]).abs().max())
            assert ours[form][i].dtype == theirs[form][i].dtype
            assert err_ours <= 4 * FP32_ATOL * scale, (form, what, err_ours)
            assert err_theirs <= 4 * FP32_ATOL * scale, (form, what, err_theirs)
            torch.testing.assert_close(ours[form][i], theirs[form][i], atol=4 * FP32_ATOL * scale, rtol=1e-4)


def _fp64(x):
    """Every tensor of x in fp64."""
    return {k: v.double() for k, v in x.items()}


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_conv_matches_transformers(shape):
    """The conv over a sequence (fresh: causal_conv1d_fn) and a decode step from a state (causal_conv1d_update,
    whose state is [B, D, W - 1] channels-first, updated in place)."""
    c = testing.make_conv_inputs(shape, seed=2)
    x, w, state = c["x"], c["weight"], c["conv_state"]
    ours, new = kda.causal_conv_reference(x, w, output_final_state=True)
    theirs = M.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    if shape.T >= shape.W - 1:  # the state is the last W - 1 inputs
        torch.testing.assert_close(new, x[:, -(shape.W - 1):].float(), atol=0, rtol=0)
    hf_state = state.transpose(1, 2).contiguous()
    step, step_state = kda.causal_conv_update_reference(x[:, 0], state, w)
    theirs_step = M.causal_conv1d_update(x[:, :1].transpose(1, 2), hf_state, w, None, activation="silu")
    torch.testing.assert_close(step, theirs_step[:, :, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(step_state, hf_state.transpose(1, 2), atol=0, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_chunked_state_equals_recurrent_state(shape):
    """fp32, on the cpu kernel: the chunked and recurrent forms' outputs and final states within the tolerance
    table of the fp64 recurrence (and fp64: to 1e-10)."""
    backend = "cpu"
    x = testing.make_kda_inputs(shape, seed=4)
    exact = kda.recurrent(**_fp64(x), output_final_state=True, use_qk_l2norm=True, backend=backend)
    rec = kda.recurrent(**x, output_final_state=True, use_qk_l2norm=True, backend=backend)
    chk = kda.chunked(**x, output_final_state=True, chunk_size=shape.C, use_qk_l2norm=True, backend=backend)
    for i in range(2):
        assert testing.compare_to_fp64(chk[i], rec[i], exact[i], torch.float32).passed
    chk64 = kda.chunked(**_fp64(x), output_final_state=True, chunk_size=shape.C, use_qk_l2norm=True,
                        backend=backend)
    for i in range(2):
        assert float((chk64[i] - exact[i]).abs().max()) <= 1e-10


@pytest.mark.parametrize("T,n", [(37, 3), (16, 1), (1, 4)])
def test_prefill_then_decode_equals_longer_prefill(T, n):
    """fp32: chunked prefill of T tokens, then n recurrent steps from its state (conv too), equals a chunked prefill
    of T + n tokens: the decoded outputs and the final states, to the fp32 row of the tolerance table."""
    s = testing.KDAShape(2, T + n, 2, 16, 8, C=16)
    x = testing.make_kda_inputs(s, seed=6, initial_state=False)
    c = testing.make_conv_inputs(s, seed=6, conv_state=False)
    o_full, s_full = kda.chunked(**x, output_final_state=True, chunk_size=16, use_qk_l2norm=True)
    co_full, cs_full = kda.causal_conv(**c, output_final_state=True)
    _, state = kda.chunked(**{k: v[:, :T] for k, v in x.items()}, output_final_state=True, chunk_size=16,
                           use_qk_l2norm=True)
    _, conv_state = kda.causal_conv(c["x"][:, :T], c["weight"], output_final_state=True)
    atol, rtol = testing.TOLERANCES[torch.float32]
    for t in range(T, T + n):
        o, state = kda.recurrent(**{k: v[:, t:t + 1] for k, v in x.items()}, initial_state=state,
                                 output_final_state=True, use_qk_l2norm=True)
        co, conv_state = kda.causal_conv_update(c["x"][:, t], conv_state, c["weight"])
        torch.testing.assert_close(o[:, 0], o_full[:, t], atol=atol, rtol=rtol)
        torch.testing.assert_close(co, co_full[:, t], atol=atol, rtol=rtol)
    torch.testing.assert_close(state, s_full, atol=atol, rtol=rtol)
    torch.testing.assert_close(conv_state, cs_full, atol=0, rtol=0)


def test_chunk_size_and_padding_do_not_change_the_function():
    """T = 37 with chunks of 1, 3, 4, 16, 64 (one partial chunk) and 37: the same outputs and states in fp64 (the cpu
    kernel pads a chunk to a power of two and halves it: 1 has no level, 3 and 37 are padded)."""
    x = testing.make_kda_inputs(SHAPES[0], dtype=torch.float64, seed=8)
    base = kda.recurrent_reference(**x, output_final_state=True)
    for C in (1, 3, 4, 16, 64, 37):
        for fn in (kda.chunked_reference, lambda **t: kda.chunked(**t, backend="cpu")):
            o, s = fn(**x, output_final_state=True, chunk_size=C)
            assert float((o - base[0]).abs().max()) <= 1e-10 and float((s - base[1]).abs().max()) <= 1e-10


def test_empty_and_stateless_calls():
    s = testing.KDAShape(1, 1, 2, 8, 4)
    x = testing.make_kda_inputs(s, initial_state=False)
    o, state = kda.chunked(**x)
    assert o.shape == (1, 1, 2, 4) and state is None
    o, state = kda.recurrent(**x, output_final_state=True)
    assert state.dtype == torch.float32 and state.shape == (1, 2, 8, 4)
    xb = {k: v.to(torch.bfloat16) for k, v in x.items()}
    o, state = kda.chunked(**xb, output_final_state=True)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32  # the state stays fp32


# --------------------------------------------------------------------------------------------- gradients
def _grad_inputs(seed=10):
    s = testing.KDAShape(1, 5, 1, 2, 2, C=4)  # two chunks, the second partial
    return {k: v.requires_grad_() for k, v in testing.make_kda_inputs(s, dtype=torch.float64, seed=seed).items()}


@pytest.mark.parametrize("form", ["reference", pytest.param("cpu", marks=pytest.mark.slow)])
def test_chunked_gradcheck(form):
    """fp64 gradcheck through the output and the final state, every input (the initial state included). The cpu
    kernel's case is slow-marked: test_cpu_kernel_gradients_equal_the_reference covers it in the default run."""
    x = _grad_inputs()
    names = sorted(x)

    def fn(*args):
        t = dict(zip(names, args))
        call = kda.chunked_reference if form == "reference" else kda.chunked
        extra = {} if form == "reference" else {"backend": "cpu"}
        o, s = call(**t, output_final_state=True, chunk_size=4, use_qk_l2norm=True, **extra)
        return o, s

    assert torch.autograd.gradcheck(fn, tuple(x[n] for n in names), atol=1e-7)


def test_conv_gradcheck():
    s = testing.KDAShape(1, 5, 1, 1, 1, W=3)
    c = {k: v.requires_grad_() for k, v in testing.make_conv_inputs(s, dtype=torch.float64, seed=12).items()}
    assert torch.autograd.gradcheck(
        lambda x, w, st: kda.causal_conv(x, w, conv_state=st, output_final_state=True),
        (c["x"], c["weight"], c["conv_state"]))


@pytest.mark.parametrize("gate", ["lower_bound", "near_zero", "mixed_steep"])
@pytest.mark.parametrize("C", [64, 37])
def test_cpu_kernel_at_the_gate_extremes(gate, C):
    """The cpu kernel's factored in-chunk decays (products through a block's first row, both factors <= 1) stay
    finite and within the fp32 tolerance of the fp64 recurrence where the in-chunk decay spans hundreds (g at the
    lower bound -5 over a 64-token chunk), where it barely decays, and with steep unbounded gates (-60, the softplus
    gate has no lower bound) mixed with near-zero ones; a power-of-two chunk and a padded one."""
    s = testing.KDAShape(1, 150, 2, 32, 16, C=C)
    x = testing.make_kda_inputs(s, seed=20)
    if gate == "lower_bound":
        x["g"] = torch.full_like(x["g"], testing.KDA_LOWER_BOUND)
    elif gate == "near_zero":
        x["g"] = x["g"] * 1e-3
    else:
        steep = testing.randn(x["g"].shape, seed=21) > 1.0
        x["g"] = torch.where(steep, torch.full_like(x["g"], -60.0), x["g"] * 1e-2)
    exact = kda.recurrent_reference(**_fp64(x), output_final_state=True, use_qk_l2norm=True)
    got = kda.chunked(**x, output_final_state=True, chunk_size=C, use_qk_l2norm=True, backend="cpu")
    rec = kda.recurrent_reference(**x, output_final_state=True, use_qk_l2norm=True)
    for i in range(2):
        assert bool(torch.isfinite(got[i]).all())
        if gate == "mixed_steep":  # the chunked form's own error here (the previous kernel's too): 2.5e-5
            assert float((got[i].double() - exact[i]).abs().max()) <= 1e-4
        else:
            assert testing.compare_to_fp64(got[i], rec[i], exact[i], torch.float32).passed


def test_cpu_kernel_gradients_equal_the_reference():
    s = testing.KDAShape(2, 21, 2, 16, 8, C=16)
    x = testing.make_kda_inputs(s, seed=14)

    def grads(call):
        leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
        o, st = call(**leaves, output_final_state=True, chunk_size=16, use_qk_l2norm=True)
        (o * testing.randn(o.shape, seed=1)).sum().backward(retain_graph=True)
        (st * testing.randn(st.shape, seed=2)).sum().backward()
        return {k: leaves[k].grad for k in sorted(leaves)}

    got, want = grads(lambda **t: kda.chunked(**t, backend="cpu")), grads(kda.chunked_reference)
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=1e-4, msg=k)


# --------------------------------------------------------------------------------------------- determinism
def _run(x, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
        o, s = kda.chunked(**leaves, output_final_state=True, chunk_size=64, use_qk_l2norm=True, backend="cpu")
        (o.sum() + s.sum()).backward()
        r = kda.recurrent(**x, output_final_state=True, use_qk_l2norm=True, backend="cpu")
        return [o, s, *r, *(leaves[k].grad for k in sorted(leaves))]
    finally:
        torch.set_num_threads(before)


def test_cpu_bitwise_across_runs_and_thread_counts():
    x = testing.make_kda_inputs(testing.KDAShape(2, 150, 2, 32, 32, C=64), seed=16)
    base = _run(x, 1)
    for threads in (1, 2, 3):
        again = _run(x, threads)
        assert all(torch.equal(a, b) for a, b in zip(base, again)), threads


def test_cpu_kernel_is_registered_and_declines_growing_gates():
    assert registry.resolve("kda_chunked", "cpu").kernel is not None
    x = testing.make_kda_inputs(SHAPES[3], seed=18)
    x["g"] = x["g"].abs()  # g > 0: a growing state
    ok, why = registry.resolve("kda_chunked", "cpu").kernel.supports(**x)
    assert not ok and "g <= 0" in why
    with registry.record_fallbacks() as fallbacks:
        o, s = kda.chunked(**x, output_final_state=True, chunk_size=16, backend="cpu")
    assert any(op == "kda_chunked" for op, _ in fallbacks)
    ref = kda.chunked_reference(**x, output_final_state=True, chunk_size=16)
    assert torch.equal(o, ref[0]) and torch.equal(s, ref[1])


# --------------------------------------------------------------------------------------------- errors
def test_argument_errors_name_the_argument():
    x = testing.make_kda_inputs(SHAPES[3])
    with pytest.raises(ValueError, match="^v: expected"):
        kda.chunked(**{**x, "v": x["v"][:, :2]})
    with pytest.raises(TypeError, match="^initial_state: expected torch.float32"):
        kda.recurrent(**{**x, "initial_state": x["initial_state"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="^chunk_size"):
        kda.chunked(**x, chunk_size=0)
    with pytest.raises(TypeError, match="^output_final_state"):
        kda.chunked(**x, output_final_state=1)
    c = testing.make_conv_inputs(SHAPES[3])
    with pytest.raises(ValueError, match="^activation"):
        kda.causal_conv(c["x"], c["weight"], activation="gelu")
    with pytest.raises(ValueError, match="^conv_state"):
        kda.causal_conv(c["x"], c["weight"], conv_state=c["conv_state"][:, :1])
    with pytest.raises(TypeError, match="^conv_state"):
        kda.causal_conv_update(c["x"][:, 0], None, c["weight"])
