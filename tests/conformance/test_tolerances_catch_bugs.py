"""The conformance comparators are tight enough to catch plausible kernel bugs at every precision they run.

Each mutant is the reference itself run with one plausible mistake (a wrong softmax scale, a causal mask off
by one, a dropped RoPE term, a skipped selected key, one Newton-Schulz step short, Polar Express without its
safety factors). Its output must FAIL the same comparison a backend faces in ``glm5_core.conformance``; if a
tolerance in ``glm5_core.testing`` is loosened past that, these tests fail.
"""
import dataclasses

import pytest
import torch

from glm5_core import testing
from glm5_core.conformance import TOPK_REL_TOL
from glm5_core.ops import dsa, mla, muon

SHAPE = testing.MLA_SHAPES[1]  # B2 T5 S13: odd sizes, several keys per query, room to shift the causal edge
DTYPES = testing.FLOAT_DTYPES_UNDER_TEST


def _fp64(x):
    return {k: v.double() if v.is_floating_point() else v for k, v in x.items()}


def _mla_mutant(kind, x, scale, start):
    """(inputs, scale, start_pos) a buggy kernel would effectively use."""
    if kind == "scale_without_rope_dims":
        return x, SHAPE.Dn ** -0.5, start
    if kind == "rope_term_dropped":
        return {**x, "q_pe": torch.zeros_like(x["q_pe"])}, scale, start
    if kind == "mask_one_key_short":  # keys s < p visible instead of s <= p
        return x, scale, start - 1
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["scale_without_rope_dims", "rope_term_dropped", "mask_one_key_short"])
@pytest.mark.parametrize("op", ["mla_prefill", "mla_decode"])
def test_mla_mutants_fail_the_comparison(op, kind, dtype):
    ref = mla.prefill_reference if op == "mla_prefill" else mla.decode_reference
    x = testing.make_mla_inputs(SHAPE, dtype=dtype, seed=1)
    scale, start = (SHAPE.Dn + SHAPE.Dr) ** -0.5, SHAPE.S - SHAPE.T
    bad_x, bad_scale, bad_start = _mla_mutant(kind, x, scale, start)
    cmp = testing.compare_to_fp64(ref(**bad_x, scale=bad_scale, start_pos=bad_start),
                                  ref(**x, scale=scale, start_pos=start),
                                  ref(**_fp64(x), scale=scale, start_pos=start), dtype)
    assert not cmp.passed, f"{kind} at {dtype} passed: {cmp.detail}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_attention_skipping_one_selected_key_fails_the_comparison(dtype):
    x = testing.make_sparse_inputs(SHAPE, 4, dtype=dtype, seed=5)
    scale = (SHAPE.Dn + SHAPE.Dr) ** -0.5
    skipped = x["topk_idx"].clone()
    skipped[..., -1] = -1  # the last slot of every row (a full row of 4 keys loses one)
    ref = dsa.sparse_attention_reference
    cmp = testing.compare_to_fp64(ref(**{**x, "topk_idx": skipped}, scale=scale), ref(**x, scale=scale),
                                  ref(**_fp64(x), scale=scale), dtype)
    assert not cmp.passed, cmp.detail


def test_indexer_topk_that_sees_one_key_past_the_causal_edge_fails_the_set_rule():
    shape = testing.INDEXER_SHAPES[1]
    x = testing.make_indexer_inputs(shape, dtype=torch.bfloat16, seed=3)
    start = shape.S - shape.T - 1
    scores64 = dsa.indexer_scores_reference(**_fp64(x), start_pos=start)
    leaky = dsa.indexer_topk_reference(x["q"], x["k"], x["w"], topk=shape.K, start_pos=start + 1)
    ref = dsa.indexer_topk_reference(x["q"], x["k"], x["w"], topk=shape.K, start_pos=start)
    assert not torch.equal(leaky, ref)  # the mutant must actually select something else
    assert not testing.topk_sets_agree(leaky, ref, scores64, TOPK_REL_TOL[torch.bfloat16]).passed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [s for s in testing.MUON_SHAPES if min(s[-2:]) > 1], ids=str)
@pytest.mark.parametrize("kind", ["one_step_short", "no_safety_factors"])
def test_polar_express_mutants_fail_the_comparison(kind, shape, dtype):
    schedule = muon.coefficients_for("polar_express")
    G = testing.make_muon_input(shape, dtype=dtype, seed=13)
    if kind == "one_step_short":
        bad = muon.orthogonalize_reference(G, steps=4, coefficients=schedule)
    else:
        raw = tuple((a * 1.01, b * 1.01**3, c * 1.01**5) for a, b, c in schedule.steps[:-1]) + schedule.steps[-1:]
        bad = muon.orthogonalize_reference(G, steps=5, coefficients=dataclasses.replace(schedule, steps=raw,
                                                                                       norm_scale=1.0))
    cmp = testing.compare_to_fp64(bad, muon.orthogonalize_reference(G, steps=5, coefficients=schedule),
                                  muon.orthogonalize_reference(G.double(), steps=5, coefficients=schedule), dtype)
    assert not cmp.passed, f"{kind} at {dtype} passed: {cmp.detail}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("shape", [s for s in testing.MUON_SHAPES if min(s[-2:]) > 1], ids=str)
def test_a_bf16_compute_kernel_one_step_short_fails_the_bf16_compute_check(shape, dtype):
    """The bf16-compute checks allow twice the bf16 reference's own error: still far less than one step."""
    schedule = muon.coefficients_for("polar_express")
    G = testing.make_muon_input(shape, dtype=dtype, seed=13)
    bad = muon.orthogonalize_reference(G, steps=4, coefficients=schedule, compute_dtype=torch.bfloat16)
    cmp = testing.compare_to_fp64(bad, muon.orthogonalize_reference(G, steps=5, coefficients=schedule,
                                                                    compute_dtype=torch.bfloat16),
                                  muon.orthogonalize_reference(G.double(), steps=5, coefficients=schedule), dtype)
    assert not cmp.passed, cmp.detail
