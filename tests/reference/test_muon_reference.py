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
