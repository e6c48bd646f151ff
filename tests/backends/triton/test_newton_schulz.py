"""Batched Newton-Schulz (Triton, symmetric Gram products) against the reference."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import muon
from tests.backends.triton.helpers import kernel


@pytest.mark.parametrize("shape", [(7, 13), (70, 20), (3, 5, 9), (2, 2, 33, 66)], ids=str)
@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
def test_matches_reference_fp32(shape, coefficients, device):
    G = testing.make_muon_input(shape, device=device, seed=len(shape))
    schedule = muon.coefficients_for(coefficients)
    out = kernel("muon_orthogonalize")(G, steps=5, coefficients=schedule)
    ref = muon.orthogonalize_reference(G, steps=5, coefficients=schedule)
    assert out.shape == G.shape and out.dtype == G.dtype
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_bf16_rounds_like_the_reference(device):
    G = testing.make_muon_input((40, 24), dtype=torch.bfloat16, device=device, seed=1)
    schedule = muon.coefficients_for("polar_express")
    out = kernel("muon_orthogonalize")(G, steps=5, coefficients=schedule)
    ref = muon.orthogonalize_reference(G, steps=5, coefficients=schedule)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - ref.float()).abs().max()) <= 2 ** -7  # at most about one bf16 rounding


def test_gram_products_are_exactly_symmetric(device):
    from glm5_core.backends.triton.launch import LaunchConfig
    from glm5_core.backends.triton.newton_schulz import _symmetric

    small_tiles = LaunchConfig(blocks={"m": 16, "n": 16, "k": 16})  # 40 rows -> 3 x 3 tiles, 6 computed
    X = testing.randn((2, 40, 50), seed=3, device=device)
    A = _symmetric(X, None, 0.0, 1.0, small_tiles)
    assert torch.equal(A, A.transpose(1, 2))
    torch.testing.assert_close(A, X @ X.transpose(1, 2), atol=1e-4, rtol=1e-5)
    B = _symmetric(A, A, -2.0, 0.5, small_tiles)
    torch.testing.assert_close(B, -2.0 * A + 0.5 * A @ A, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("shape", [(7, 13), (70, 20), (1, 24), (24, 1), (3, 5, 9), (2, 2, 33, 66), (4, 96, 128)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bf16_compute_matches_the_bf16_reference(shape, dtype, device):
    """bf16 tl.dot with fp32 accumulators (widened under the interpreter), each product rounded once (ties
    to even): the bf16-compute reference up to the accumulation order."""
    G = testing.make_muon_input(shape, dtype=dtype, device=device, seed=len(shape))
    schedule = muon.coefficients_for("polar_express")
    out = kernel("muon_orthogonalize")(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    ref = muon.orthogonalize_reference(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    exact = muon.orthogonalize_reference(G.double(), steps=5, coefficients=schedule)
    assert out.shape == G.shape and out.dtype == dtype
    verdict = testing.compare_to_fp64(out, ref, exact, dtype)
    assert verdict.passed, verdict.detail
    assert torch.equal(out.float(), out.float().bfloat16().float())  # iterated in bf16, not a wider dtype
    if dtype == torch.float32:
        assert not torch.equal(out, kernel("muon_orthogonalize")(G, steps=5, coefficients=schedule))


def test_bf16_gram_product_rounds_to_nearest_even(device):
    """The symmetric kernel's bf16 output is the fp32 product rounded once (the interpreter's own store
    would truncate): bit for bit the reference's rounding of the same fp32 sums, up to accumulation order."""
    from glm5_core.backends.triton.launch import LaunchConfig
    from glm5_core.backends.triton.newton_schulz import _symmetric

    small_tiles = LaunchConfig(blocks={"m": 16, "n": 16, "k": 16})
    X = (testing.randn((2, 40, 50), seed=3, device=device) / 8).bfloat16()
    A = _symmetric(X, None, 0.0, 1.0, small_tiles)
    assert A.dtype == torch.bfloat16 and torch.equal(A, A.transpose(1, 2))
    wide = X.double() @ X.double().transpose(1, 2)
    nearest = wide.bfloat16()  # the fp64 product rounded once
    assert float((A.double() - nearest.double()).abs().max()) <= float(wide.abs().max()) * 2 ** -8
    assert (A != nearest).float().mean() < 0.01  # truncation would differ in about half the entries
