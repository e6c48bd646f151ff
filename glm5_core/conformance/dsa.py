"""Conformance checks of the DSA family (``glm5_core.ops.dsa``): the indexer's scores and top-k (exact where
ties are exact, by the set rule elsewhere), the selected-key scores, sparse MLA prefill / decode / expanded
prefill, the selected-attention target, and the backward inputs of the family's differentiable ops."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from glm5_core import testing
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn, GradCase, fp64
from glm5_core.ops import dsa

TOPK_REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


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
        scores = dsa.indexer_scores_reference(**fp64(x), start_pos=start)
        return testing.topk_sets_agree(idx, ref_idx, scores, TOPK_REL_TOL[dtype])

    return fn


KPOOL_SHAPE = testing.IndexerShape(B=2, T=13, S=31, H=3, D=16, K=8)  # pools of 4: 7 of them and a partial one


def _kpool_check(dtype: torch.dtype, ties: Optional[str], kpool: int = 4, select_tail: bool = True) -> CheckFn:
    """The k-pool top-k against its reference: with exact (tied) scores bitwise; else the same tail and pool
    selections that differ only where the fp64 pool scores are within the tolerance of the last kept one."""
    from glm5_core.ops.kpool_topk import kpool_scores_reference, pool_keys

    def fn(backend: str, device: str) -> testing.Comparison:
        s = KPOOL_SHAPE
        x = testing.make_indexer_inputs(s, dtype=dtype, device=device, seed=7, ties=ties)
        gate = testing.randn((s.B, s.S, s.D), seed=8, dtype=dtype, device=device)
        if ties == "duplicate_keys":  # keys of period 3 and gates of period 3: pools tie in groups
            gate = gate[:, :3].repeat(1, -(-s.S // 3), 1)[:, :s.S]
        ape = testing.randn((kpool, s.D), seed=9, dtype=dtype, device=device)
        start = s.S - s.T
        kw = dict(topk=s.K, kpool=kpool, select_tail=select_tail, start_pos=start)
        idx = dsa.kpool_topk(x["q"], x["k"], x["w"], gate, ape, **kw, backend=backend)
        ref = dsa.kpool_topk_reference(x["q"], x["k"], x["w"], gate, ape, scale=s.D ** -0.5, **kw)
        if idx.dtype != torch.int32 or idx.shape != ref.shape:
            return testing.Comparison(False, float("inf"), 0.0, f"got {idx.dtype} {tuple(idx.shape)}, want int32 "
                                                                f"{tuple(ref.shape)}")
        idx = idx.cpu()
        if torch.equal(idx, ref.cpu()):
            return testing.Comparison(True, 0.0, 0.0, "bitwise equal to the reference")
        if ties is not None:
            return testing.Comparison(False, float("inf"), 0.0, "differs from the reference with exactly tied scores")
        x64 = fp64(dict(x, gate=gate, ape=ape))
        pooled = pool_keys(x64["k"], x64["gate"], x64["ape"], kpool)
        scores = kpool_scores_reference(x64["q"], pooled, x64["w"], scale=s.D ** -0.5, start_pos=start,
                                        kpool=kpool).cpu()
        worst = 0.0
        for b in range(s.B):
            for t in range(s.T):
                got_row, want_row = idx[b, t].tolist(), ref[b, t].tolist()
                if [v < 0 for v in got_row] != [v < 0 for v in want_row]:
                    return testing.Comparison(False, float("inf"), 0.0, f"row ({b},{t}): -1 padding differs")
                pools = [sorted({v // kpool for v in r[:s.K] if v >= 0}) for r in (got_row, want_row)]
                if got_row[s.K:] != want_row[s.K:] or len(pools[0]) != len(pools[1]):
                    return testing.Comparison(False, float("inf"), 0.0, f"row ({b},{t}): the tail differs")
                if pools[0] == pools[1]:
                    continue
                kth = float(scores[b, t, pools[1]].min())
                for j in set(pools[0]) ^ set(pools[1]):
                    worst = max(worst, abs(float(scores[b, t, j]) - kth) / max(abs(kth), 1e-30))
        tol = TOPK_REL_TOL[dtype]
        return testing.Comparison(worst <= tol, worst, tol, f"pools differ only within {worst:.3g} (relative) of the "
                                                            f"last kept pool's score")

    return fn


def _scores_check(shape: testing.IndexerShape, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_indexer_inputs(shape, dtype=dtype, device=device, seed=4)
        start = shape.S - shape.T
        out = dsa.indexer_scores(x["q"], x["k"], x["w"], start_pos=start, backend=backend)
        ref = dsa.indexer_scores_reference(x["q"], x["k"], x["w"], start_pos=start)
        ref64 = dsa.indexer_scores_reference(**fp64(x), start_pos=start)
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
        x64 = fp64(x)
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
        return testing.compare_to_fp64(out, ref(**x, scale=scale), ref(**fp64(x), scale=scale), dtype)

    return fn


def _sparse_expanded_check(shape: testing.MLAShape, K: int, dtype: torch.dtype) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_sparse_expanded_inputs(shape, K, dtype=dtype, device=device, seed=5)
        scale = (shape.Dn + shape.Dr) ** -0.5
        out = dsa.sparse_prefill_expanded(**x, scale=scale, backend=backend)
        ref = dsa.sparse_prefill_expanded_reference
        return testing.compare_to_fp64(out, ref(**x, scale=scale), ref(**fp64(x), scale=scale), dtype)

    return fn


def _selected_target_check(shape: testing.MLAShape, K: int, dtype: torch.dtype, ragged: bool,
                           expanded: bool, normaliser: str = "selected") -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        start = torch.arange(shape.B, device=device) % (shape.S - shape.T + 1) if ragged else shape.S - shape.T
        x = testing.make_sparse_inputs(shape, K, dtype=dtype, device=device, seed=6, start_pos=start)
        x.pop("w_uv")
        x64 = fp64(x)
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


def checks() -> list[Check]:
    checks = []
    for dtype, ties in ((torch.float32, None), (torch.float32, "zero_relu"), (torch.bfloat16, None),
                        (torch.bfloat16, "duplicate_keys")):
        checks.append(Check("dsa", f"dsa_kpool_topk[{DTYPE_NAMES[dtype]}-{KPOOL_SHAPE}-kpool4-ties_{ties}]",
                            ("dsa_kpool_topk",), _kpool_check(dtype, ties)))
    checks.append(Check("dsa", f"dsa_kpool_topk[fp32-{KPOOL_SHAPE}-kpool1-no_tail]", ("dsa_kpool_topk",),
                        _kpool_check(torch.float32, None, kpool=1, select_tail=False)))
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


# --------------------------------------------------------------------------------------------- gradients
_GRAD_MLA = testing.MLA_SHAPES[1]
_GRAD_MLA_PADDED = testing.MLAShape(B=2, T=7, S=11, H=3, Dn=8, Dr=4, Dv=6, C=20)
_GRAD_INDEXER_K1 = testing.IndexerShape(B=2, T=5, S=5, H=3, D=7, K=1)


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


# Inputs of the backward check of each differentiable op of the family (see ``gradients.py``).
GRAD_CASES: dict[str, Callable[[str], GradCase]] = {
    "dsa_indexer_scores": _indexer_scores_grad,
    "dsa_sparse_prefill": _sparse_prefill_grad,
    "dsa_selected_index_scores": _selected_index_scores_grad,
    "dsa_sparse_prefill_expanded": _sparse_expanded_grad,
}
# Edge cases of the backward checks: (op, tag, inputs). Sparse prefill: K = 1, and K past the visible keys
# (queries at positions 0..T-1: -1 padded rows).
GRAD_EDGE_CASES: tuple[tuple[str, str, Callable[[str], GradCase]], ...] = (
    ("dsa_sparse_prefill", "K1", lambda dev: _sparse_prefill_grad(dev, _GRAD_MLA, K=1)),
    ("dsa_sparse_prefill", "padded", lambda dev: _sparse_prefill_grad(dev, _GRAD_MLA_PADDED, K=9, start_pos=0)),
    ("dsa_selected_index_scores", "K1", lambda dev: _selected_index_scores_grad(dev, _GRAD_INDEXER_K1)),
    ("dsa_sparse_prefill_expanded", "K1", lambda dev: _sparse_expanded_grad(dev, _GRAD_MLA, K=1)),
    ("dsa_sparse_prefill_expanded", "padded",
     lambda dev: _sparse_expanded_grad(dev, _GRAD_MLA_PADDED, K=9, start_pos=0)),
)
# Ops whose backward is also checked with bf16 inputs (their kernels have a bf16 path).
BF16_GRAD_OPS = ("dsa_sparse_prefill", "dsa_sparse_prefill_expanded", "dsa_selected_index_scores")
