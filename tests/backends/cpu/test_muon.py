"""Native Newton-Schulz vs the reference (same coefficients: reference-level agreement) and vs SVD."""
import pytest
import torch

from glm5_core import testing
from glm5_core.backends.cpu import muon as native_muon
from glm5_core.ops import muon

SHAPES = testing.MUON_SHAPES + ((4, 24, 70), (70, 24))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("name", sorted(muon.COEFFICIENTS))
def test_matches_reference(native, shape, dtype, name):
    G = testing.make_muon_input(shape, dtype=dtype, seed=8)
    coefficients = muon.COEFFICIENTS[name]
    got = native_muon.orthogonalize(G, steps=5, coefficients=coefficients)
    same_precision = muon.orthogonalize_reference(G, steps=5, coefficients=coefficients)
    exact = muon.orthogonalize_reference(G.to(torch.float64), steps=5, coefficients=coefficients)
    assert got.shape == G.shape and got.dtype == dtype
    verdict = testing.compare_to_fp64(got, same_precision, exact, dtype)
    assert verdict.passed, verdict.detail


@pytest.mark.parametrize("loop", (False, True))
def test_batching_policies_agree(native, monkeypatch, loop):
    """The loop and the batched path compute the same function (policy changes speed, not results)."""
    monkeypatch.setattr(native_muon, "use_loop", lambda batch, m, n: loop)
    G = testing.make_muon_input((5, 16, 40), seed=9, dtype=torch.float64)
    got = native_muon.orthogonalize(G, steps=6, coefficients=muon.COEFFICIENTS["polar_express"])
    want = muon.orthogonalize_reference(G, steps=6, coefficients=muon.COEFFICIENTS["polar_express"])
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_polar_express_reaches_polar_factor(native):
    G = testing.make_muon_input((3, 12, 30), seed=10, dtype=torch.float64)
    X = native_muon.orthogonalize(G, steps=10, coefficients=muon.COEFFICIENTS["polar_express"])
    assert float((X - testing.polar_factor(G)).abs().max()) < 1e-2
    assert testing.orthogonality_error(X) < 1e-2


BF16_SHAPES = SHAPES + ((24, 1), (1, 1), (72, 96, 128), (2, 3, 40, 17))


@pytest.mark.parametrize("shape", BF16_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_bf16_compute_matches_the_bf16_reference(native, shape, dtype):
    """Each bf16 GEMM rounds once after its epilogue, as the reference does: they differ by the fp32
    accumulation order only (small matrices agree bit for bit on this machine), within the reference's own
    distance to the fp64 iteration."""
    G = testing.make_muon_input(shape, dtype=dtype, seed=8)
    schedule = muon.COEFFICIENTS["polar_express"]
    got = native_muon.orthogonalize(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    same_precision = muon.orthogonalize_reference(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    exact = muon.orthogonalize_reference(G.to(torch.float64), steps=5, coefficients=schedule)
    assert got.shape == G.shape and got.dtype == dtype
    verdict = testing.compare_to_fp64(got, same_precision, exact, dtype)
    assert verdict.passed, verdict.detail


def test_bf16_compute_iterates_in_bf16(native):
    """Not a more precise fp32 iteration: the output is bf16-valued for fp32 input, and differs from fp32's."""
    G = testing.make_muon_input((4, 24, 70), seed=11)
    schedule = muon.COEFFICIENTS["polar_express"]
    got = native_muon.orthogonalize(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    assert torch.equal(got, got.bfloat16().float())
    assert not torch.equal(got, native_muon.orthogonalize(G, steps=5, coefficients=schedule))


@pytest.mark.parametrize("loop", (False, True))
def test_batching_policies_agree_in_bf16(native, monkeypatch, loop):
    monkeypatch.setattr(native_muon, "use_loop", lambda batch, m, n: loop)
    G = testing.make_muon_input((5, 16, 40), seed=9)
    schedule = muon.COEFFICIENTS["polar_express"]
    got = native_muon.orthogonalize(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    want = muon.orthogonalize_reference(G, steps=5, coefficients=schedule, compute_dtype=torch.bfloat16)
    verdict = testing.compare_to_fp64(got, want, muon.orthogonalize_reference(G.double(), steps=5,
                                                                              coefficients=schedule), torch.float32)
    assert verdict.passed, verdict.detail


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_custom_op_passes_opcheck(native, dtype):
    X = testing.make_muon_input((3, 8, 20), dtype=dtype, seed=12) / 8
    schedule = torch.tensor(muon.COEFFICIENTS["polar_express"].schedule(3), dtype=torch.float64)
    for loop in (False, True):
        torch.library.opcheck(torch.ops.glm5_cpu.ns_orthogonalize, (X, schedule, loop))
