"""Conformance suite: every check a backend must pass, shared by ``tests/conformance`` and ``glm5 conformance``.

A check runs one op (or a determinism property) of a backend on seeded inputs and compares the result with
the reference: floats against an fp64 run of the reference (``testing.compare_to_fp64``), integer outputs
(top-k, routing ids, dispatch order) exactly where the inputs make ties exact, and by the cross-backend
set rule elsewhere. ``glm5 conformance --backend X`` runs them all and writes a JSON and a Markdown report.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform as py_platform
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from glm5_core import conformance_ep, determinism, registry, testing
from glm5_core.ops import dsa, mla, moe, muon

FAMILIES = ("mla", "dsa", "moe", "ep", "muon", "gradients", "determinism")
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
TOPK_REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

CheckFn = Callable[[str, str], testing.Comparison]  # (backend, device) -> comparison


@dataclasses.dataclass(frozen=True)
class Check:
    family: str
    name: str
    ops: Sequence[str]
    fn: CheckFn
    # False: a property (determinism, two forms agreeing) worth checking on the reference too
    against_reference: bool = True

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass
class Result:
    family: str
    check: str
    ops: List[str]
    status: str  # "pass" | "fail" | "error" | "fallback"
    max_error: Optional[float]
    allowed: Optional[float]
    detail: str
    seconds: float


def _fp64(inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in inputs.items()}


# --------------------------------------------------------------------------------------------- MLA
def _mla_check(op: str, shape: testing.MLAShape, dtype: torch.dtype, start_mode: str) -> CheckFn:
    entry = mla.prefill if op == "mla_prefill" else mla.decode

    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_mla_inputs(shape, dtype=dtype, device=device, seed=1)
        start = testing.start_positions_for(shape.B, shape.T, shape.S, start_mode, device)
        scale = (shape.Dn + shape.Dr) ** -0.5
        out = entry(**x, scale=scale, start_pos=start, backend=backend)
        ref = registry.reference(op)
        return testing.compare_to_fp64(out, ref(**x, scale=scale, start_pos=start),
                                       ref(**_fp64(x), scale=scale, start_pos=start), dtype)

    return fn


def _mla_forms_agree(shape: testing.MLAShape) -> CheckFn:
    """The backend's expanded prefill and absorbed decode agree in fp64 (to 1e-10)."""

    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_mla_inputs(shape, dtype=torch.float64, device=device, seed=2)
        scale = (shape.Dn + shape.Dr) ** -0.5
        start = shape.S - shape.T
        expanded = mla.prefill(**x, scale=scale, start_pos=start, backend=backend)
        absorbed = mla.decode(**x, scale=scale, start_pos=start, backend=backend)
        err = float((expanded - absorbed).abs().max())
        return testing.Comparison(err <= 1e-10, err, 1e-10, f"max |expanded - absorbed| = {err:.3g} (fp64)")

    return fn


def _mla_checks() -> List[Check]:
    checks = []
    for op in ("mla_prefill", "mla_decode"):
        for shape in testing.MLA_SHAPES:
            for dtype in testing.FLOAT_DTYPES_UNDER_TEST:
                for start_mode in ("last", "ragged") if op == "mla_decode" else ("first", "ragged"):
                    name = f"{op}[{DTYPE_NAMES[dtype]}-{shape}-start_{start_mode}]"
                    checks.append(Check("mla", name, (op,), _mla_check(op, shape, dtype, start_mode)))
    for shape in testing.VENDOR_MLA_SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            checks.append(Check("mla", f"mla_decode[vendor-{DTYPE_NAMES[dtype]}-{shape}-start_last]", ("mla_decode",),
                                _mla_check("mla_decode", shape, dtype, "last")))
    for shape in testing.MLA_SHAPES:
        checks.append(Check("mla", f"mla_expanded_vs_absorbed[fp64-{shape}]", ("mla_prefill", "mla_decode"),
                            _mla_forms_agree(shape), against_reference=False))
    return checks


# --------------------------------------------------------------------------------------------- DSA
def _topk_check(shape: testing.IndexerShape, dtype: torch.dtype, ties: Optional[str], ragged: bool,
                weights_dtype: torch.dtype = torch.float32) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_indexer_inputs(shape, dtype=dtype, device=device, seed=3, ties=ties,
                                        weights_dtype=weights_dtype)
        start = (torch.tensor([(shape.S - shape.T) // (b + 1) for b in range(shape.B)], device=device)
                 if ragged else shape.S - shape.T)
        idx = dsa.indexer_topk(x["q"], x["k"], x["w"], shape.K, start_pos=start, backend=backend)
        ref_idx = dsa.indexer_topk_reference(x["q"], x["k"], x["w"], topk=shape.K, start_pos=start)
        if ties is not None:  # exact scores: the contract fixes every index, ties to the lower key
            same = torch.equal(idx.cpu(), ref_idx.cpu()) and idx.dtype == torch.int32
            return testing.Comparison(same, 0.0 if same else float("inf"), 0.0,
                                      "bitwise equal to the reference" if same else
                                      f"differs from the reference (first rows: {idx.cpu()[0, :2].tolist()} vs "
                                      f"{ref_idx[0, :2].tolist()})")
        scores = dsa.indexer_scores_reference(**_fp64(x), start_pos=start)
        return testing.topk_sets_agree(idx, ref_idx, scores, TOPK_REL_TOL[dtype])

    return fn


def _scores_check(shape: testing.IndexerShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_indexer_inputs(shape, dtype=dtype, device=device, seed=4)
        start = shape.S - shape.T
        out = dsa.indexer_scores(x["q"], x["k"], x["w"], start_pos=start, backend=backend)
        ref = dsa.indexer_scores_reference(x["q"], x["k"], x["w"], start_pos=start)
        ref64 = dsa.indexer_scores_reference(**_fp64(x), start_pos=start)
        if not torch.equal(torch.isinf(out).cpu(), torch.isinf(ref64).cpu()):
            return testing.Comparison(False, float("inf"), 0.0, "causal -inf mask differs from the reference")
        finite = torch.isfinite(ref64)
        return testing.compare_to_fp64(out[finite], ref[finite], ref64[finite], dtype)

    return fn


def _selected_inputs(shape: testing.IndexerShape, dtype: torch.dtype, device: str, seed: int):
    """(indexer inputs, their top-k [B, T, K] with -1 padding in the early rows and one -1 mid-row)."""
    x = testing.make_indexer_inputs(shape, dtype=dtype, device=device, seed=seed)
    idx = dsa.indexer_topk_reference(*(x[n].float() for n in ("q", "k", "w")), topk=shape.K, start_pos=0)
    idx[0, -1, 0] = -1
    return x, idx


def _selected_scores_check(shape: testing.IndexerShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x, idx = _selected_inputs(shape, dtype, device, seed=4)
        out = dsa.selected_index_scores(x["q"], x["k"], x["w"], idx, backend=backend)
        keep = idx >= 0
        if not torch.equal(torch.isneginf(out).cpu(), (~keep).cpu()):
            return testing.Comparison(False, float("inf"), 0.0, "-inf slots differ from the -1 slots of topk_idx")
        x64 = _fp64(x)
        ref = dsa.selected_index_scores_reference(x["q"], x["k"], x["w"], idx)
        ref64 = dsa.selected_index_scores_reference(x64["q"], x64["k"], x64["w"], idx)
        return testing.compare_to_fp64(out[keep], ref[keep], ref64[keep], dtype)

    return fn


def _sparse_check(op: str, shape: testing.MLAShape, K: int, dtype: torch.dtype) -> CheckFn:
    entry = dsa.sparse_prefill if op == "dsa_sparse_prefill" else dsa.sparse_decode

    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_sparse_inputs(shape, K, dtype=dtype, device=device, seed=5)
        scale = (shape.Dn + shape.Dr) ** -0.5
        out = entry(**x, scale=scale, backend=backend)
        ref = dsa.sparse_attention_reference
        return testing.compare_to_fp64(out, ref(**x, scale=scale), ref(**_fp64(x), scale=scale), dtype)

    return fn


def _sparse_expanded_check(shape: testing.MLAShape, K: int, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_sparse_expanded_inputs(shape, K, dtype=dtype, device=device, seed=5)
        scale = (shape.Dn + shape.Dr) ** -0.5
        out = dsa.sparse_prefill_expanded(**x, scale=scale, backend=backend)
        ref = dsa.sparse_prefill_expanded_reference
        return testing.compare_to_fp64(out, ref(**x, scale=scale), ref(**_fp64(x), scale=scale), dtype)

    return fn


def _selected_target_check(shape: testing.MLAShape, K: int, dtype: torch.dtype, ragged: bool,
                           expanded: bool, normaliser: str = "selected") -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        start = torch.arange(shape.B, device=device) % (shape.S - shape.T + 1) if ragged else shape.S - shape.T
        x = testing.make_sparse_inputs(shape, K, dtype=dtype, device=device, seed=6, start_pos=start)
        x.pop("w_uv")
        x64 = _fp64(x)
        kw = dict(scale=(shape.Dn + shape.Dr) ** -0.5, start_pos=start, normaliser=normaliser)
        kw64 = dict(kw)
        if expanded:  # the model's expanded keys, in the compute dtype
            ct = torch.float64 if dtype == torch.float64 else torch.float32
            kw["k_nope"] = torch.einsum("bsc,hdc->bshd", x["c_kv"].to(ct), x["w_uk"].to(ct))  # [B, S, H, Dn]
            kw64["k_nope"] = kw["k_nope"].double()
        out = dsa.selected_attention_target(**x, **kw, backend=backend)
        ref = dsa.selected_attention_target_reference(**x, **kw)
        ref64 = dsa.selected_attention_target_reference(**x64, **kw64)
        if bool((out[x["topk_idx"] < 0] != 0).any()):
            return testing.Comparison(False, float("inf"), 0.0, "the -1 slots of topk_idx are not 0")
        return testing.compare_to_fp64(out, ref, ref64, dtype)

    return fn


def _dsa_checks() -> List[Check]:
    checks = []
    for shape in testing.INDEXER_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for ties in testing.TIE_MODES:
                name = f"dsa_indexer_topk[{DTYPE_NAMES[dtype]}-{shape}-ties_{ties}]"
                checks.append(Check("dsa", name, ("dsa_indexer_topk",), _topk_check(shape, dtype, ties, False)))
            checks.append(Check("dsa", f"dsa_indexer_topk[{DTYPE_NAMES[dtype]}-{shape}-ragged]",
                                ("dsa_indexer_topk",), _topk_check(shape, dtype, None, True)))
            checks.append(Check("dsa", f"dsa_indexer_scores[{DTYPE_NAMES[dtype]}-{shape}]", ("dsa_indexer_scores",),
                                _scores_check(shape, dtype)))
            checks.append(Check("dsa", f"dsa_selected_index_scores[{DTYPE_NAMES[dtype]}-{shape}]",
                                ("dsa_selected_index_scores",), _selected_scores_check(shape, dtype)))
    vendor = testing.VENDOR_INDEXER_SHAPE
    for dtype in (torch.bfloat16, torch.float16):
        for ties in (None, "integer"):
            checks.append(Check("dsa", f"dsa_indexer_topk[vendor-{DTYPE_NAMES[dtype]}-{vendor}-ties_{ties}]",
                                ("dsa_indexer_topk",), _topk_check(vendor, dtype, ties, False, weights_dtype=dtype)))
        checks.append(Check("dsa", f"dsa_indexer_topk[vendor-{DTYPE_NAMES[dtype]}-{vendor}-ragged]",
                            ("dsa_indexer_topk",), _topk_check(vendor, dtype, None, True, weights_dtype=dtype)))
    for op in ("dsa_sparse_prefill", "dsa_sparse_decode"):
        for shape, K in zip(testing.MLA_SHAPES, (1, 4, 9)):
            for dtype in testing.FLOAT_DTYPES_UNDER_TEST:
                checks.append(Check("dsa", f"{op}[{DTYPE_NAMES[dtype]}-{shape}-K{K}]", (op,),
                                    _sparse_check(op, shape, K, dtype)))
        for shape in testing.VENDOR_MLA_SHAPES:
            checks.append(Check("dsa", f"{op}[vendor-bf16-{shape}-K64]", (op,),
                                _sparse_check(op, shape, 64, torch.bfloat16)))
    op = "dsa_sparse_prefill_expanded"
    for shape, K in zip(testing.MLA_SHAPES, (1, 4, 9)):
        for dtype in testing.FLOAT_DTYPES_UNDER_TEST:
            checks.append(Check("dsa", f"{op}[{DTYPE_NAMES[dtype]}-{shape}-K{K}]", (op,),
                                _sparse_expanded_check(shape, K, dtype)))
    op = "dsa_selected_attention_target"
    for shape, K in zip(testing.MLA_SHAPES, (1, 4, 9)):
        for dtype in testing.FLOAT_DTYPES_UNDER_TEST:
            for ragged, expanded in ((False, False), (True, True)):
                form = ("ragged-" if ragged else "") + ("expanded" if expanded else "latent")
                for normaliser, tag in (("selected", ""), ("causal", "-causal")):  # the default keeps its names
                    checks.append(Check("dsa", f"{op}[{DTYPE_NAMES[dtype]}-{shape}-K{K}-{form}{tag}]", (op,),
                                        _selected_target_check(shape, K, dtype, ragged, expanded, normaliser)))
    return checks


# --------------------------------------------------------------------------------------------- MoE
def _route_check(shape: testing.MoEShape, dtype: torch.dtype, ties: Optional[str], score_func: str) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_route_inputs(shape, dtype=dtype, device=device, seed=6, ties=ties)
        kw = dict(top_k=shape.K, score_func=score_func, n_group=shape.G, topk_group=shape.TG,
                  renormalize=True, routed_scaling_factor=2.5)
        weights, ids = moe.route(x["logits"], x["bias"], backend=backend, **kw)
        ref_w, ref_ids = moe.route_reference(x["logits"], x["bias"], **kw)
        if ids.dtype != torch.int32 or not torch.equal(ids.cpu(), ref_ids.cpu()):
            return testing.Comparison(False, float("inf"), 0.0,
                                      f"expert ids differ from the reference ({ids.dtype}; first row "
                                      f"{ids.cpu()[0].tolist()} vs {ref_ids[0].tolist()})")
        ref64_w, ref64_ids = moe.route_reference(x["logits"].double(), x["bias"].double(), **kw)
        if not torch.equal(ref64_ids.cpu().long(), ref_ids.cpu().long()):  # near-tie flipped by rounding: compare
            ref64_w = ref_w.double()  # weights of the same experts instead
        return testing.compare_to_fp64(weights, ref_w, ref64_w, torch.float32)

    return fn


def _reference_routing(shape: testing.MoEShape, device: str, seed: int):
    """(weights [N, K], ids [N, K]) from the reference router on seeded logits, scale 2.5."""
    logits = testing.make_route_inputs(shape, device=device, seed=seed)["logits"]
    return moe.route_reference(logits, None, top_k=shape.K, routed_scaling_factor=2.5)


def _dispatch_check(shape: testing.MoEShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=7)
        _, ids = _reference_routing(shape, device, seed=8)
        got = moe.dispatch(x["x"], ids, num_experts=shape.E, backend=backend)
        want = moe.dispatch_reference(x["x"], ids, num_experts=shape.E)
        names = ("x_sorted", "sort_idx", "counts")
        for name, a, b in zip(names, got, want):
            if a.dtype != b.dtype:  # torch.equal compares values across dtypes
                return testing.Comparison(False, float("inf"), 0.0, f"{name} is {a.dtype}, the reference's {b.dtype}")
            if not torch.equal(a.cpu(), b.cpu()):
                return testing.Comparison(False, float("inf"), 0.0, f"{name} differs from the reference")
        return testing.Comparison(True, 0.0, 0.0, "x_sorted, sort_idx and counts bitwise equal")

    return fn


def _combine_check(shape: testing.MoEShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=9)
        weights, ids = _reference_routing(shape, device, seed=10)
        y_sorted, sort_idx, _ = moe.dispatch_reference(x["x"], ids, num_experts=shape.E)
        out = moe.combine(y_sorted, sort_idx, weights, backend=backend)
        ref = moe.combine_reference
        return testing.compare_to_fp64(out, ref(y_sorted, sort_idx, weights),
                                       ref(y_sorted.double(), sort_idx, weights.double()), dtype)

    return fn


def _experts_check(shape: testing.MoEShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=11)
        _, ids = _reference_routing(shape, device, seed=12)
        x_sorted, _, counts = moe.dispatch_reference(x["x"], ids, num_experts=shape.E)
        w = (x["w_gate"], x["w_up"], x["w_down"])
        out = moe.grouped_swiglu(x_sorted, counts, *w, backend=backend)
        ref = moe.grouped_swiglu_reference
        return testing.compare_to_fp64(out, ref(x_sorted, counts, *w),
                                       ref(x_sorted.double(), counts, *(t.double() for t in w)), dtype)

    return fn


def _fused_experts_check(shape: testing.MoEShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=26)
        weights, ids = _reference_routing(shape, device, seed=27)
        args = (x["x"], weights.to(dtype), ids, x["w_gate"], x["w_up"], x["w_down"])
        out = moe.fused_experts(*args, backend=backend)
        ref = moe.fused_experts_reference
        return testing.compare_to_fp64(out, ref(*args), ref(*(t.double() if t.is_floating_point() else t
                                                              for t in args)), dtype)

    return fn


def _moe_checks() -> List[Check]:
    checks = []
    for shape in testing.MOE_SHAPES + (testing.VENDOR_MOE_SHAPE,):
        for ties in (None, "integer"):
            for score_func in moe.SCORE_FUNCS:
                checks.append(Check("moe", f"moe_route[fp32-{shape}-{score_func}-ties_{ties}]", ("moe_route",),
                                    _route_check(shape, torch.float32, ties, score_func)))
        checks.append(Check("moe", f"moe_route[bf16-{shape}-sigmoid]", ("moe_route",),
                            _route_check(shape, torch.bfloat16, None, "sigmoid")))
        for dtype in testing.FLOAT_DTYPES_UNDER_TEST:
            tag = f"{DTYPE_NAMES[dtype]}-{shape}"
            checks.append(Check("moe", f"moe_dispatch[{tag}]", ("moe_dispatch",), _dispatch_check(shape, dtype)))
            checks.append(Check("moe", f"moe_combine[{tag}]", ("moe_combine",), _combine_check(shape, dtype)))
            checks.append(Check("moe", f"moe_experts[{tag}]", ("moe_experts",), _experts_check(shape, dtype)))
            checks.append(Check("moe", f"moe_fused_experts[{tag}]", ("moe_fused_experts",),
                                _fused_experts_check(shape, dtype)))
    return checks


# --------------------------------------------------------------------------------------------- Muon
def _muon_check(shape: Sequence[int], dtype: torch.dtype, coefficients: str,
                compute_dtype: torch.dtype = torch.float32) -> CheckFn:
    """Against the reference at the same compute dtype and the fp64 iteration: with bf16 compute the kernel
    may be at most ERROR_FACTOR times as far from the fp64 result as the bf16-compute reference is."""
    def fn(backend: str, device: str) -> testing.Comparison:
        G = testing.make_muon_input(shape, dtype=dtype, device=device, seed=13)
        out = muon.orthogonalize(G, steps=5, coefficients=coefficients, compute_dtype=compute_dtype, backend=backend)
        schedule = muon.coefficients_for(coefficients)
        ref = muon.orthogonalize_reference
        cmp = testing.compare_to_fp64(out, ref(G, steps=5, coefficients=schedule, compute_dtype=compute_dtype),
                                      ref(G.double(), steps=5, coefficients=schedule), dtype)
        cmp.detail += f"; orthogonality error max|sigma - 1| = {testing.orthogonality_error(out):.3g}"
        return cmp

    return fn


def _muon_name(shape: Sequence[int], dtype: torch.dtype, coefficients: str, suffix: str = "") -> str:
    return f"muon_orthogonalize[{DTYPE_NAMES[dtype]}-{'x'.join(map(str, shape))}-{coefficients}{suffix}]"


def _muon_checks() -> List[Check]:
    fp32_compute = [Check("muon", _muon_name(shape, dtype, coef), ("muon_orthogonalize",),
                          _muon_check(shape, dtype, coef))
                    for shape in testing.MUON_SHAPES for dtype in testing.FLOAT_DTYPES_UNDER_TEST
                    for coef in ("jordan", "polar_express")]
    bf16_compute = [Check("muon", _muon_name(shape, dtype, "polar_express", "-bf16_compute"), ("muon_orthogonalize",),
                          _muon_check(shape, dtype, "polar_express", torch.bfloat16))
                    for shape in testing.MUON_SHAPES for dtype in (torch.float32, torch.bfloat16)]
    return fp32_compute + bf16_compute


# --------------------------------------------------------------------------------------------- gradients
# A gradient case: (entry point call taking the backend first, reference call, float inputs to differentiate).
GradCase = Tuple[Callable, Callable, Dict[str, torch.Tensor]]
_GRAD_MLA = testing.MLA_SHAPES[1]
_GRAD_MOE = testing.MOE_SHAPES[2]
_GRAD_SCALE = (_GRAD_MLA.Dn + _GRAD_MLA.Dr) ** -0.5


def _mla_prefill_grad(device: str) -> GradCase:
    x = testing.make_mla_inputs(testing.MLA_SHAPES[2], device=device, seed=21)  # T == S: a full prefill
    return (lambda be, **t: mla.prefill(**t, scale=_GRAD_SCALE, backend=be),
            lambda **t: mla.prefill_reference(**t, scale=_GRAD_SCALE), x)


def _sparse_grad_case(op: Callable, reference: Callable, make_inputs: Callable, device: str,
                      shape: testing.MLAShape, K: int, start_pos) -> GradCase:
    """A sparse-attention op and its reference over ``make_inputs(shape, K)``, the selected keys held fixed."""
    x = make_inputs(shape, K, device=device, seed=21, start_pos=start_pos)
    idx = x.pop("topk_idx")
    scale = (shape.Dn + shape.Dr) ** -0.5
    return (lambda be, **t: op(**t, topk_idx=idx, scale=scale, backend=be),
            lambda **t: reference(**t, topk_idx=idx, scale=scale), x)


def _sparse_prefill_grad(device: str, shape: testing.MLAShape = _GRAD_MLA, K: int = 4,
                         start_pos=None) -> GradCase:
    return _sparse_grad_case(dsa.sparse_prefill, dsa.sparse_attention_reference, testing.make_sparse_inputs,
                             device, shape, K, start_pos)


def _sparse_expanded_grad(device: str, shape: testing.MLAShape = _GRAD_MLA, K: int = 4,
                          start_pos=None) -> GradCase:
    return _sparse_grad_case(dsa.sparse_prefill_expanded, dsa.sparse_prefill_expanded_reference,
                             testing.make_sparse_expanded_inputs, device, shape, K, start_pos)


def _indexer_scores_grad(device: str) -> GradCase:
    shape = testing.INDEXER_SHAPES[1]
    x = testing.make_indexer_inputs(shape, device=device, seed=22)
    start = shape.S - shape.T

    def finite(scores):  # -inf entries carry no gradient; compare the visible scores
        return scores.masked_fill(torch.isinf(scores), 0.0)

    return (lambda be, **t: finite(dsa.indexer_scores(**t, start_pos=start, backend=be)),
            lambda **t: finite(dsa.indexer_scores_reference(**t, start_pos=start)), x)


def _selected_index_scores_grad(device: str, shape: testing.IndexerShape = testing.INDEXER_SHAPES[1]) -> GradCase:
    x, idx = _selected_inputs(shape, torch.float32, device, seed=22)
    keep = idx >= 0

    def finite(scores):  # the -inf slots carry no gradient; compare the selected scores
        return scores.masked_fill(~keep, 0.0)

    return (lambda be, **t: finite(dsa.selected_index_scores(**t, topk_idx=idx, backend=be)),
            lambda q, k, w: finite(dsa.selected_index_scores_reference(q, k, w, idx)), x)


def _route_grad(device: str) -> GradCase:
    x = testing.make_route_inputs(_GRAD_MOE, device=device, seed=23)
    bias = x.pop("bias")
    kw = dict(top_k=_GRAD_MOE.K, n_group=_GRAD_MOE.G, topk_group=_GRAD_MOE.TG, routed_scaling_factor=2.5)
    return (lambda be, **t: moe.route(**t, bias=bias, backend=be, **kw)[0],
            lambda **t: moe.route_reference(**t, bias=bias, **kw)[0], x)


def _expert_grad_inputs(device: str, shape: testing.MoEShape = _GRAD_MOE):
    """(expert inputs, routing weights [N, K], ids [N, K]) shared by the dispatch / experts / combine cases."""
    x = testing.make_expert_inputs(shape, device=device, seed=24)
    logits = testing.make_route_inputs(shape, device=device, seed=25)["logits"]
    weights, ids = moe.route_reference(logits, None, top_k=shape.K)
    return x, weights, ids


def _dispatch_grad(device: str) -> GradCase:
    x, _, ids = _expert_grad_inputs(device)
    E = _GRAD_MOE.E
    return (lambda be, **t: moe.dispatch(**t, expert_ids=ids, num_experts=E, backend=be)[0],
            lambda **t: moe.dispatch_reference(**t, expert_ids=ids, num_experts=E)[0], {"x": x["x"]})


def _fused_experts_grad(device: str, shape: testing.MoEShape = _GRAD_MOE) -> GradCase:
    x, weights, ids = _expert_grad_inputs(device, shape)
    return (lambda be, **t: moe.fused_experts(**t, expert_ids=ids, backend=be),
            lambda **t: moe.fused_experts_reference(**t, expert_ids=ids),
            {"x": x["x"], "weights": weights, "w_gate": x["w_gate"], "w_up": x["w_up"], "w_down": x["w_down"]})


def _combine_grad(device: str) -> GradCase:
    x, weights, ids = _expert_grad_inputs(device)
    x_sorted, sort_idx, _ = moe.dispatch_reference(x["x"], ids, num_experts=_GRAD_MOE.E)
    return (lambda be, **t: moe.combine(**t, sort_idx=sort_idx, backend=be),
            lambda **t: moe.combine_reference(**t, sort_idx=sort_idx), {"y_sorted": x_sorted, "weights": weights})


def _experts_grad(device: str, shape: testing.MoEShape = _GRAD_MOE) -> GradCase:
    x, _, ids = _expert_grad_inputs(device, shape)
    x_sorted, _, counts = moe.dispatch_reference(x["x"], ids, num_experts=shape.E)
    return (lambda be, **t: moe.grouped_swiglu(**t, counts=counts, backend=be),
            lambda **t: moe.grouped_swiglu_reference(**t, counts=counts),
            {"x_sorted": x_sorted, "w_gate": x["w_gate"], "w_up": x["w_up"], "w_down": x["w_down"]})


# Inputs of the backward check of each op declared ``differentiable`` (small odd shapes).
GRAD_CASES: Dict[str, Callable[[str], GradCase]] = {
    "mla_prefill": _mla_prefill_grad,
    "dsa_indexer_scores": _indexer_scores_grad,
    "dsa_sparse_prefill": _sparse_prefill_grad,
    "dsa_selected_index_scores": _selected_index_scores_grad,
    "dsa_sparse_prefill_expanded": _sparse_expanded_grad,
    "moe_route": _route_grad,
    "moe_dispatch": _dispatch_grad,
    "moe_combine": _combine_grad,
    "moe_experts": _experts_grad,
    "moe_fused_experts": _fused_experts_grad,
    **conformance_ep.GRAD_CASES,  # the expert-parallel family's (group=None)
}


# Edge cases of the backward checks: name -> (op, inputs). Experts: K = 1 with more experts than tokens (most
# receive none). Sparse prefill: K = 1, and K past the visible keys (queries at positions 0..T-1: -1 padded rows).
_GRAD_MOE_SPARSE_ROUTING = testing.MoEShape(N=6, E=9, K=1, G=1, TG=1, D=12, F=10)
_GRAD_MLA_PADDED = testing.MLAShape(B=2, T=7, S=11, H=3, Dn=8, Dr=4, Dv=6, C=20)
_GRAD_INDEXER_K1 = testing.IndexerShape(B=2, T=5, S=5, H=3, D=7, K=1)
GRAD_EDGE_CASES: Tuple[Tuple[str, str, Callable[[str], GradCase]], ...] = (  # (op, tag, inputs)
    ("moe_experts", "K1-empty_experts", lambda dev: _experts_grad(dev, _GRAD_MOE_SPARSE_ROUTING)),
    ("moe_fused_experts", "K1-empty_experts", lambda dev: _fused_experts_grad(dev, _GRAD_MOE_SPARSE_ROUTING)),
    ("dsa_sparse_prefill", "K1", lambda dev: _sparse_prefill_grad(dev, _GRAD_MLA, K=1)),
    ("dsa_sparse_prefill", "padded", lambda dev: _sparse_prefill_grad(dev, _GRAD_MLA_PADDED, K=9, start_pos=0)),
    ("dsa_selected_index_scores", "K1", lambda dev: _selected_index_scores_grad(dev, _GRAD_INDEXER_K1)),
    ("dsa_sparse_prefill_expanded", "K1", lambda dev: _sparse_expanded_grad(dev, _GRAD_MLA, K=1)),
    ("dsa_sparse_prefill_expanded", "padded",
     lambda dev: _sparse_expanded_grad(dev, _GRAD_MLA_PADDED, K=9, start_pos=0)),
)
# Ops whose backward is also checked with bf16 inputs (their kernels have a bf16 path): the rest take fp32 grads.
BF16_GRAD_OPS = ("dsa_sparse_prefill", "dsa_sparse_prefill_expanded", "dsa_selected_index_scores", "moe_experts",
                 "moe_dispatch", "moe_combine", "moe_fused_experts")


def grad_ops() -> Tuple[str, ...]:
    """The ops whose declaration (``OpSpec.differentiable``) says training needs their gradient."""
    return tuple(name for name, spec in registry.op_specs().items() if spec.differentiable)


def _grad_case(op: str, device: str) -> GradCase:
    if op not in GRAD_CASES:
        raise ValueError(f"{op} is declared differentiable but glm5_core.conformance.GRAD_CASES has no inputs "
                         f"for its backward check; add a case for it")
    return GRAD_CASES[op](device)


def _grad_check(op: str, case: Callable[[str], GradCase], dtype: torch.dtype = torch.float32) -> CheckFn:
    """The backend's output carries gradients whenever the reference's does, and they match.

    fp32: the gradients of every input together against the fp64 reference. bf16: inputs and cotangent
    rounded to bf16 once, and the same rounded values run in fp64 for the exact gradients; each input's
    gradient is judged on its own by ``testing.compare_to_fp64``: at most ERROR_FACTOR times the error the
    reference itself makes at bf16 (fp32 arithmetic, gradients rounded to bf16), plus the bf16 atol."""

    def fn(backend: str, device: str) -> testing.Comparison:
        entry, ref, inputs = case(device)
        if dtype != torch.float32:
            inputs = {k: v.to(dtype) for k, v in inputs.items()}

        def grads(call, run_dtype):
            leaves = {k: v.detach().to(run_dtype).clone().requires_grad_() for k, v in inputs.items()}
            out = call(**leaves)
            if not out.requires_grad:
                return None
            cotangent = testing.randn(out.shape, seed=31, dtype=dtype, device=out.device).to(run_dtype)
            torch.autograd.backward(out, cotangent)
            return {k: leaves[k].grad for k in sorted(leaves)}

        got = grads(lambda **t: entry(backend, **t), dtype)
        if got is None:
            return testing.Comparison(False, float("inf"), 0.0, "output does not require grad: gradients are dropped")
        want, exact = grads(ref, dtype), grads(ref, torch.float64)
        if dtype == torch.float32:
            flat = [torch.cat([g[k].flatten() for k in sorted(g)]) for g in (got, want, exact)]
            return testing.compare_to_fp64(*flat, dtype)
        per_input = {k: testing.compare_to_fp64(got[k], want[k], exact[k], dtype) for k in sorted(got)}
        def badness(item):  # failures first, then the largest share of the allowance used
            cmp = item[1]
            return (not cmp.passed, cmp.max_error / max(cmp.allowed, 1e-30))

        name, worst = max(per_input.items(), key=badness)
        return testing.Comparison(all(c.passed for c in per_input.values()), worst.max_error, worst.allowed,
                                  f"d{name} (worst of {len(per_input)} inputs): {worst.detail}")

    return fn


def _grad_checks() -> List[Check]:
    checks = []
    for op in grad_ops():
        variants = [("", lambda dev, op=op: _grad_case(op, dev))]
        variants += [(f"{tag}-", case) for case_op, tag, case in GRAD_EDGE_CASES if case_op == op]
        for tag, case in variants:
            for dtype in (torch.float32, torch.bfloat16) if op in BF16_GRAD_OPS else (torch.float32,):
                checks.append(Check("gradients", f"{op}[backward-{tag}{DTYPE_NAMES[dtype]}]", (op,),
                                    _grad_check(op, case, dtype)))
    return checks


def _determinism_checks() -> List[Check]:
    return [Check("determinism", name, tuple(determinism.CHECK_OPS[name]), fn, against_reference=False)
            for name, fn in determinism.CHECKS.items()]


def _ep_checks() -> List[Check]:
    return [Check("ep", name, ops, fn) for name, ops, fn in conformance_ep.checks()]


_BUILDERS = {"mla": _mla_checks, "dsa": _dsa_checks, "moe": _moe_checks, "ep": _ep_checks, "muon": _muon_checks,
             "gradients": _grad_checks, "determinism": _determinism_checks}


def checks(family: Optional[str] = None) -> List[Check]:
    """All conformance checks, or those of one family."""
    if family is not None and family not in _BUILDERS:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    return [c for fam in ([family] if family else FAMILIES) for c in _BUILDERS[fam]()]


def _fell_back(op: str, backend: str, declined: Dict[str, str]) -> bool:
    """``op`` ran the reference in this check: it has no kernel on ``backend``, its kernel declined a call, or
    (a composite whose fused kernel declined) every part did."""
    if op in declined or registry.runs_reference(op, backend):
        return True
    parts = registry.op_spec(op).parts
    return any(p in declined for p in parts) and all(_fell_back(p, backend, declined) for p in parts)


def run_check(check: Check, backend: str) -> Result:
    """Run one check; ops that ran the reference (no kernel, or a kernel that declined the check's calls) are
    reported as ``fallback`` (or ``fail`` in strict mode)."""
    start = time.perf_counter()
    try:
        if registry.strict_mode():
            for op in check.ops:
                registry.resolve(op, backend)  # raises BackendCoverageError naming the op
        device = registry.get_backend(backend).device()
        with registry.record_fallbacks() as declined_calls:
            cmp = check.fn(backend, device)
        declined = dict(reversed(declined_calls))  # op -> why (its first declined call)
        # (under GLM5_STRICT=1 every fallback has raised: nothing fell back)
        fallbacks = [] if registry.strict_mode() else [op for op in check.ops if _fell_back(op, backend, declined)]
        status = "pass" if cmp.passed else "fail"
        if cmp.passed and fallbacks and len(fallbacks) == len(check.ops):
            status = "fallback"
        notes = [f"{op} ({declined[op]})" if op in declined else op for op in fallbacks]
        notes += [f"{op} ({why})" for op, why in declined.items() if op not in check.ops]  # parts of a composite
        detail = cmp.detail + (f" (reference fallback: {', '.join(notes)})" if notes else "")
        return Result(check.family, check.name, list(check.ops), status, cmp.max_error, cmp.allowed, detail,
                      time.perf_counter() - start)
    except registry.BackendCoverageError as exc:
        return Result(check.family, check.name, list(check.ops), "fail", None, None, str(exc),
                      time.perf_counter() - start)
    except Exception as exc:  # a crashing kernel is a failed check, with its traceback in the report
        tb = traceback.format_exc(limit=4)
        return Result(check.family, check.name, list(check.ops), "error", None, None, f"{exc!r}\n{tb}",
                      time.perf_counter() - start)


# --------------------------------------------------------------------------------------------- reports
def environment(backend: str) -> Dict[str, str]:
    be = registry.get_backend(backend)
    ok, reason = be.available()
    return {
        "backend": backend,
        "status": reason,
        "device": be.device() if ok else be.device_type,
        "torch": torch.__version__,
        "python": py_platform.python_version(),
        "machine": f"{py_platform.system()} {py_platform.machine()}",
        "strict": str(registry.strict_mode()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_reports(results: List[Result], backend: str, out_dir: Path) -> Dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "fallback")}
    coverage = [{"op": r.op, "implementation": r.label, "reason": r.reason} for r in registry.explain(backend)]
    payload = {"environment": environment(backend), "summary": counts, "coverage": coverage,
               "results": [dataclasses.asdict(r) for r in results]}
    json_path = out_dir / f"conformance-{backend}.json"
    json_path.write_text(json.dumps(payload, indent=2))
    env = payload["environment"]
    lines = [f"# glm5-core conformance report: `{backend}`", "",
             " | ".join(f"**{k}**: {v}" for k, v in env.items()), "",
             f"**{counts['pass']} passed, {counts['fail'] + counts['error']} failed**, "
             f"{counts['fallback']} ran the reference fallback.", "", "## Op coverage", "",
             "| op | implementation | why the reference |", "|---|---|---|"]
    lines += [f"| {c['op']} | `{c['implementation']}` | {c['reason']} |" for c in coverage]
    for family in FAMILIES:
        rows = [r for r in results if r.family == family]
        if not rows:
            continue
        lines += ["", f"## {family}", "", "| check | status | max error | allowed | detail |", "|---|---|---|---|---|"]
        for r in rows:
            err = "" if r.max_error is None else f"{r.max_error:.3g}"
            allowed = "" if r.allowed is None else f"{r.allowed:.3g}"
            detail = r.detail.splitlines()[0].replace("|", "\\|") if r.detail else ""
            lines.append(f"| `{r.check}` | {r.status} | {err} | {allowed} | {detail} |")
    md_path = out_dir / f"conformance-{backend}.md"
    md_path.write_text("\n".join(lines) + "\n")
    return {"json": json_path, "markdown": md_path}


# --------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from glm5_core.cli import add_backend_argument

    add_backend_argument(parser)
    parser.add_argument("--out", default="conformance-report", help="folder for the JSON and Markdown reports")
    parser.add_argument("--family", choices=FAMILIES, action="append",
                        help="run only these op families (repeatable; default: all)")
    parser.add_argument("--strict", action="store_true", help="same as GLM5_STRICT=1: every reference fallback fails")


def run(args: argparse.Namespace) -> int:
    if args.strict:
        os.environ["GLM5_STRICT"] = "1"
    backend = registry.require_available(registry.resolve_backend_name(args.backend)).name
    out_dir = Path(args.out)
    try:  # before the checks run, not after
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot create the report folder {str(out_dir)!r}: {exc.strerror}") from exc
    selected = [c for fam in (args.family or FAMILIES) for c in checks(fam)]
    results = []
    try:
        from tqdm import tqdm

        progress = tqdm(selected, desc=f"conformance[{backend}]", unit="check", leave=False, disable=None)
    except ImportError:
        progress = selected
    for check in progress:
        results.append(run_check(check, backend))
    paths = write_reports(results, backend, out_dir)
    bad = [r for r in results if r.status in ("fail", "error")]
    n_fallback = sum(r.status == "fallback" for r in results)
    n_pass = sum(r.status == "pass" for r in results)
    print(f"{backend}: {n_pass} passed, {len(bad)} failed, {n_fallback} passed on the reference fallback")
    for r in bad[:20]:
        print(f"  FAIL {r.check}: {r.detail.splitlines()[0] if r.detail else ''}")
    if registry.strict_mode():
        missing = sorted({op for r in bad for op in r.ops if "GLM5_STRICT" in r.detail})
        if missing:
            print(f"GLM5_STRICT=1: {backend} lacks {', '.join(missing)}")
    print(f"reports: {paths['json']}  {paths['markdown']}")
    return 1 if bad else 0


def assert_conforms(backend: str, check: Check) -> None:
    """pytest form of :func:`run_check`: skip checks that would compare the reference with itself."""
    import pytest

    fallbacks = [op for op in check.ops if registry.runs_reference(op, backend)]
    if check.against_reference and len(fallbacks) == len(check.ops):
        pytest.skip(f"{backend} runs the reference for {', '.join(check.ops)} (the spec is tested in tests/reference)")
    result = run_check(check, backend)
    assert result.status in ("pass", "fallback"), f"{check.name} on {backend}: {result.status}: {result.detail}"
