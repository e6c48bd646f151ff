"""Conformance checks of the MoE family (``glm5_core.ops.moe``): routing (expert ids exact, weights against
fp64), dispatch (bitwise), combine, the grouped experts, the fused experts, and the backward inputs of the
family's differentiable ops."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from glm5_core import testing
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn, GradCase
from glm5_core.ops import moe


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
        out = moe.experts(x_sorted, counts, *w, backend=backend)
        ref = moe.experts_reference
        return testing.compare_to_fp64(out, ref(x_sorted, counts, *w),
                                       ref(x_sorted.double(), counts, *(t.double() for t in w)), dtype)

    return fn


def _clamping_limit(x: torch.Tensor, w_gate: torch.Tensor) -> float:
    """A ``swiglu_limit`` that clamps about half of the gate projections (their median magnitude)."""
    return float((x.double() @ w_gate[0].double().T).abs().median())


def _fused_experts_check(shape: testing.MoEShape, dtype: torch.dtype, clamped: bool = False) -> CheckFn:
    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=26)
        weights, ids = _reference_routing(shape, device, seed=27)
        args = (x["x"], weights.to(dtype), ids, x["w_gate"], x["w_up"], x["w_down"])
        kw = {"swiglu_limit": _clamping_limit(x["x"], x["w_gate"])} if clamped else {}
        out = moe.fused_experts(*args, backend=backend, **kw)
        ref = moe.fused_experts_reference
        return testing.compare_to_fp64(out, ref(*args, **kw), ref(*(t.double() if t.is_floating_point() else t
                                                                    for t in args), **kw), dtype)

    return fn


def checks() -> list[Check]:
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
    for dtype in (torch.float32, torch.bfloat16):  # GLM-5.3's clamped SwiGLU
        checks.append(Check("moe", f"moe_fused_experts[{DTYPE_NAMES[dtype]}-{_GRAD_MOE}-swiglu_limit]",
                            ("moe_fused_experts",), _fused_experts_check(_GRAD_MOE, dtype, clamped=True)))
    return checks


# --------------------------------------------------------------------------------------------- gradients
_GRAD_MOE = testing.MOE_SHAPES[2]
_GRAD_MOE_SPARSE_ROUTING = testing.MoEShape(N=6, E=9, K=1, G=1, TG=1, D=12, F=10)


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


def _fused_experts_grad(device: str, shape: testing.MoEShape = _GRAD_MOE, clamped: bool = False) -> GradCase:
    x, weights, ids = _expert_grad_inputs(device, shape)
    kw = {"swiglu_limit": _clamping_limit(x["x"], x["w_gate"])} if clamped else {}
    return (lambda be, **t: moe.fused_experts(**t, expert_ids=ids, backend=be, **kw),
            lambda **t: moe.fused_experts_reference(**t, expert_ids=ids, **kw),
            {"x": x["x"], "weights": weights, "w_gate": x["w_gate"], "w_up": x["w_up"], "w_down": x["w_down"]})


def _combine_grad(device: str) -> GradCase:
    x, weights, ids = _expert_grad_inputs(device)
    x_sorted, sort_idx, _ = moe.dispatch_reference(x["x"], ids, num_experts=_GRAD_MOE.E)
    return (lambda be, **t: moe.combine(**t, sort_idx=sort_idx, backend=be),
            lambda **t: moe.combine_reference(**t, sort_idx=sort_idx), {"y_sorted": x_sorted, "weights": weights})


def _experts_grad(device: str, shape: testing.MoEShape = _GRAD_MOE, clamped: bool = False) -> GradCase:
    x, _, ids = _expert_grad_inputs(device, shape)
    x_sorted, _, counts = moe.dispatch_reference(x["x"], ids, num_experts=shape.E)
    kw = {"swiglu_limit": _clamping_limit(x["x"], x["w_gate"])} if clamped else {}
    return (lambda be, **t: moe.experts(**t, counts=counts, backend=be, **kw),
            lambda **t: moe.experts_reference(**t, counts=counts, **kw),
            {"x_sorted": x_sorted, "w_gate": x["w_gate"], "w_up": x["w_up"], "w_down": x["w_down"]})


# Inputs of the backward check of each differentiable op of the family (see ``gradients.py``).
GRAD_CASES: dict[str, Callable[[str], GradCase]] = {
    "moe_route": _route_grad,
    "moe_dispatch": _dispatch_grad,
    "moe_combine": _combine_grad,
    "moe_experts": _experts_grad,
    "moe_fused_experts": _fused_experts_grad,
}
# Edge cases of the backward checks: (op, tag, inputs). Experts: K = 1 with more experts than tokens (most
# receive none).
GRAD_EDGE_CASES: tuple[tuple[str, str, Callable[[str], GradCase]], ...] = (
    ("moe_experts", "K1-empty_experts", lambda dev: _experts_grad(dev, _GRAD_MOE_SPARSE_ROUTING)),
    ("moe_fused_experts", "K1-empty_experts", lambda dev: _fused_experts_grad(dev, _GRAD_MOE_SPARSE_ROUTING)),
    # GLM-5.3's clamped SwiGLU: the clamps' gradients (zero past the limit)
    ("moe_experts", "swiglu_limit", lambda dev: _experts_grad(dev, clamped=True)),
    ("moe_fused_experts", "swiglu_limit", lambda dev: _fused_experts_grad(dev, clamped=True)),
)
# Ops whose backward is also checked with bf16 inputs (their kernels have a bf16 path).
BF16_GRAD_OPS = ("moe_experts", "moe_dispatch", "moe_combine", "moe_fused_experts")
