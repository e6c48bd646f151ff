"""The Muon reference: Newton-Schulz lands within each coefficient set's known error of the polar factor."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import muon


def scalar_schedule(sigma, schedule):
    """The matrix iteration acts on each singular value as the composed scalar polynomial."""
    x = sigma
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


def predicted_error(G, coefficients, steps):
    """max_i |p(sigma_i / (||G||_F * norm_scale + 1e-7)) - 1|: the exact spectral distance to U V^T."""
    sched = muon.coefficients_for(coefficients)
    sv = torch.linalg.svdvals(G.double())
    norm = torch.linalg.matrix_norm(G.double(), keepdim=False).unsqueeze(-1)
    x = scalar_schedule(sv / (norm * sched.norm_scale + 1e-7), sched.schedule(steps))
    return float((x - 1).abs().max())


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (3, 12, 20), (32, 32)], ids=str)
@pytest.mark.parametrize("coefficients,steps", [("jordan", 5), ("polar_express", 5), ("polar_express", 8)])
def test_distance_to_polar_factor_is_the_known_polynomial_error(shape, coefficients, steps):
    G = testing.make_muon_input(shape, dtype=torch.float64, seed=1)
    out = muon.orthogonalize(G, steps=steps, coefficients=coefficients)
    distance = float(torch.linalg.matrix_norm(out - testing.polar_factor(G), ord=2).max())
    assert distance == pytest.approx(predicted_error(G, coefficients, steps), abs=1e-9)


def test_known_error_bands():
    G = testing.make_muon_input((64, 256), dtype=torch.float64, seed=2)
    jordan = torch.linalg.svdvals(muon.orthogonalize(G, steps=5, coefficients="jordan"))
    assert 0.6 < float(jordan.min()) and float(jordan.max()) < 1.2  # Jordan: about [0.68, 1.13], by design
    pe = muon.orthogonalize(G, steps=8, coefficients="polar_express")
    assert testing.orthogonality_error(pe) < 1e-2  # Polar Express converges towards 1


def test_tall_matrices_are_handled_by_transposition():
    G = testing.make_muon_input((40, 12), dtype=torch.float64, seed=3)
    assert torch.allclose(muon.orthogonalize(G), muon.orthogonalize(G.T).T, atol=1e-12)


def test_batched_equals_loop_and_keeps_dtype():
    G = testing.make_muon_input((4, 8, 24), dtype=torch.bfloat16, seed=4)
    out = muon.orthogonalize(G, coefficients="jordan")
    assert out.dtype == torch.bfloat16
    for i in range(4):
        assert torch.equal(out[i], muon.orthogonalize(G[i], coefficients="jordan"))


def test_polar_express_safety_factors_apply_to_all_but_the_last_step():
    pe = muon.COEFFICIENTS["polar_express"]
    assert pe.steps[0][0] == pytest.approx(8.28721201814563 / 1.01)
    assert pe.steps[0][2] == pytest.approx(17.300387312530933 / 1.01**5)
    assert pe.steps[-1] == (1.875, -1.25, 0.375)
    assert pe.schedule(10)[9] == pe.steps[-1]


def test_custom_coefficients_and_errors():
    G = testing.make_muon_input((5, 7), dtype=torch.float64)
    assert torch.equal(muon.orthogonalize(G, coefficients=[(3.4445, -4.7750, 2.0315)]),
                       muon.orthogonalize(G, coefficients="jordan"))
    with pytest.raises(ValueError, match="coefficients"):
        muon.orthogonalize(G, coefficients="newton")
    with pytest.raises(ValueError, match="coefficients"):
        muon.orthogonalize(G, coefficients=[(1.0, 2.0)])


@pytest.mark.parametrize("dim,shape", [(0, (12, 5)), (1, (5, 12))])
def test_split_merge_round_trip_and_blocks(dim, shape):
    W = testing.make_muon_input(shape, seed=5)
    blocks = muon.split_heads(W, 3, dim=dim)
    assert blocks.shape == ((3, 4, 5) if dim == 0 else (3, 5, 4))
    assert torch.equal(muon.merge_heads(blocks, dim=dim), W)
    head1 = W[4:8] if dim == 0 else W[:, 4:8]
    assert torch.equal(blocks[1], head1)
    with pytest.raises(ValueError, match="divisible"):
        muon.split_heads(W, 5, dim=dim)


@pytest.mark.parametrize("bad,error", [
    ({"a": 1.0}, TypeError), (["abc"], TypeError), ([("1", "x", "2")], TypeError),  # used to leak "could not convert"
    ([(3.4445, float("nan"), 2.0315)], ValueError), ([(float("inf"), -4.775, 2.0315)], ValueError),  # NaN weights
])
def test_custom_coefficients_that_are_not_finite_numbers_are_named(bad, error):
    with pytest.raises(error, match="coefficients"):
        muon.orthogonalize(testing.make_muon_input((5, 7)), coefficients=bad)


# ----------------------------------------------------------------------------------- compute dtype
def _reference_before_compute_dtype(G, *, steps, coefficients):
    """The reference as it was before ``compute_dtype`` existed (ef1cb76), kept here to pin its bits."""
    X = G.to(torch.float64 if G.dtype == torch.float64 else torch.float32)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    norm = torch.linalg.matrix_norm(X, ord="fro", keepdim=True)
    X = X / (norm * coefficients.norm_scale + 1e-7)
    for a, b, c in coefficients.schedule(steps):
        A = X @ X.transpose(-2, -1)
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.transpose(-2, -1)
    return X.to(G.dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("compute_dtype", (None, torch.float32, "float32"), ids=str)
def test_fp32_compute_keeps_the_previous_bits(dtype, compute_dtype):
    schedule = muon.coefficients_for("polar_express")
    for shape in testing.MUON_SHAPES + ((4, 24, 70),):
        G = testing.make_muon_input(shape, dtype=dtype, seed=6)
        kwargs = {} if compute_dtype is None else {"compute_dtype": muon.compute_dtype_for(compute_dtype, G.device)}
        out = muon.orthogonalize_reference(G, steps=5, coefficients=schedule, **kwargs)
        assert torch.equal(out, _reference_before_compute_dtype(G, steps=5, coefficients=schedule)), shape


ODD_SHAPES = testing.MUON_SHAPES + ((24, 1), (1, 1), (16, 48), (48, 16), (3, 12, 20), (64, 256))


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_bf16_compute_rounds_every_product_to_bf16(shape):
    """fp32 input, bf16 compute: the result is a bf16 value (the iteration's last rounding), and is not the
    fp32-compute result (the iteration did run in bf16)."""
    G = testing.make_muon_input(shape, seed=7)
    out = muon.orthogonalize_reference(G, steps=5, coefficients=muon.COEFFICIENTS["polar_express"],
                                       compute_dtype=torch.bfloat16)
    assert out.dtype == torch.float32
    assert torch.equal(out, out.bfloat16().float())
    fp32 = muon.orthogonalize_reference(G, steps=5, coefficients=muon.COEFFICIENTS["polar_express"])
    assert not torch.equal(out, fp32)


# Measured over these shapes, 5 steps: error(bf16 compute) - error(fp32 compute) <= 0.027 (Jordan's 32 x 32,
# whose smallest singular values the polynomial has not reached yet; 0.01 for most shapes). bf16 may also land
# closer (1 x 1: 0.008 against 0.12), so the bound is one-sided.
BF16_ORTHOGONALITY_SLACK = 0.05


@pytest.mark.parametrize("shape", ODD_SHAPES + ((32, 32),), ids=str)
@pytest.mark.parametrize("coefficients", ("jordan", "polar_express"))
def test_bf16_compute_orthogonality_error_is_within_the_stated_bound(shape, coefficients):
    G = testing.make_muon_input(shape, seed=1)
    schedule = muon.coefficients_for(coefficients)
    fp32 = muon.orthogonalize_reference(G, steps=5, coefficients=schedule)
    bf16 = muon.orthogonalize_reference(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    err32, err16 = testing.orthogonality_error(fp32), testing.orthogonality_error(bf16)
    assert err16 <= err32 + BF16_ORTHOGONALITY_SLACK, (err16, err32)
    distance = float(torch.linalg.matrix_norm(bf16.double() - testing.polar_factor(G), ord=2).max())
    assert distance <= err32 + BF16_ORTHOGONALITY_SLACK  # and as close to U V^T (fp32 compute: exactly err32)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64), ids=str)
def test_bf16_compute_keeps_the_input_dtype_and_transposes_tall(dtype):
    G = testing.make_muon_input((40, 12), dtype=dtype, seed=3)
    schedule = muon.COEFFICIENTS["polar_express"]
    out = muon.orthogonalize_reference(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    assert out.dtype == dtype and out.shape == G.shape
    assert torch.equal(out, muon.orthogonalize_reference(G.T, steps=5, coefficients=schedule,
                                                         compute_dtype=torch.bfloat16).T)


@pytest.mark.parametrize("bad", ("bf16", "float16", torch.float16, torch.float64, 16, None))
def test_bad_compute_dtype_is_named(bad):
    with pytest.raises(ValueError, match="compute_dtype: expected torch.float32, torch.bfloat16 or one of"):
        muon.orthogonalize(testing.make_muon_input((5, 7)), compute_dtype=bad)


@pytest.mark.parametrize("native", (True, False))
def test_auto_is_bf16_exactly_where_bf16_gemms_are_native(monkeypatch, native):
    monkeypatch.setattr(muon, "native_bf16_gemm", lambda device: native)
    G = testing.make_muon_input((3, 12, 20), seed=2)
    want = torch.bfloat16 if native else torch.float32
    assert muon.compute_dtype_for("auto", G.device) == want
    assert torch.equal(muon.orthogonalize(G, compute_dtype="auto"), muon.orthogonalize(G, compute_dtype=want))


def test_native_bf16_gemm_asks_the_cpu_and_declines_other_devices():
    probes = (torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported())
    assert muon.native_bf16_gemm(torch.device("cpu")) == any(probes)
    assert muon.native_bf16_gemm(torch.device("meta")) is False
