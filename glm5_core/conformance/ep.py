"""Conformance checks of the expert-parallel family (``glm5_core.ops.ep``).

In ONE process (``group=None``: expert parallelism of size 1) a backend's ``ep_dispatch`` / ``ep_combine`` must
be bitwise the single-device reference (``moe.dispatch_reference`` / ``moe.combine_reference``), and carry the
reference's gradients; the fused ``ep_experts`` slot must agree with ``moe.fused_experts_reference`` to the
tolerance table (its GEMMs are a vendor's). The multi-process contract (EP=2 bitwise the concatenated batch on
one device, uneven routing, a bad argument raised on every rank) is the check ``ep_group[2 processes]``
(``ep_group.py``: two processes on the backend's collective); ``tests/ops/test_ep.py`` checks the reference
at 2 and 4 processes.

The runner reads :func:`checks` (the ``ep`` family, found from ``OpSpec.family``) and :data:`GRAD_CASES` (the
backward inputs, read by ``gradients.py``).
"""
from __future__ import annotations

from typing import Callable

import torch

from glm5_core import testing
from glm5_core.conformance.check import Check, GradCase
from glm5_core.ops import ep, moe

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
GRAD_SHAPE = testing.MOE_SHAPES[2]


def _inputs(shape: testing.MoEShape, dtype: torch.dtype, device: str, seed: int):
    x = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=seed)["x"]
    logits = testing.make_route_inputs(shape, device=device, seed=seed + 1)["logits"]
    weights, ids = moe.route_reference(logits, None, top_k=shape.K, routed_scaling_factor=2.5)
    return x, weights, ids


def _differs(what: str) -> testing.Comparison:
    return testing.Comparison(False, float("inf"), 0.0, what)


def _dispatch_check(shape: testing.MoEShape, dtype: torch.dtype) -> Callable[[str, str], testing.Comparison]:
    def fn(backend: str, device: str) -> testing.Comparison:
        x, weights, ids = _inputs(shape, dtype, device, seed=40)
        handle = ep.dispatch(x, ids, weights, group=None, num_experts=shape.E, backend=backend)
        rows, _, counts = moe.dispatch_reference(x, ids, num_experts=shape.E)
        for name, got, want in (("rows", handle.rows, rows), ("counts", handle.counts, counts)):
            if got.dtype != want.dtype or not torch.equal(got.cpu(), want.cpu()):
                return _differs(f"{name} differs from moe.dispatch_reference's")
        return testing.Comparison(True, 0.0, 0.0, "rows and counts bitwise moe.dispatch_reference's (group=None)")

    return fn


def _combine_check(shape: testing.MoEShape, dtype: torch.dtype) -> Callable[[str, str], testing.Comparison]:
    def fn(backend: str, device: str) -> testing.Comparison:
        x, weights, ids = _inputs(shape, dtype, device, seed=42)
        handle = ep.dispatch_reference(x, ids, weights, group=None, num_experts=shape.E)
        y = handle.rows * 1.5  # stands in for the experts' outputs
        got = ep.combine(y, handle, backend=backend)
        want = moe.combine_reference(y, handle.sort_idx, weights)
        if got.dtype != want.dtype or not torch.equal(got.cpu(), want.cpu()):
            return _differs("differs from moe.combine_reference's")
        return testing.Comparison(True, 0.0, 0.0, "bitwise moe.combine_reference's (group=None)")

    return fn


def _experts_check(shape: testing.MoEShape, dtype: torch.dtype) -> Callable[[str, str], testing.Comparison]:
    def fn(backend: str, device: str) -> testing.Comparison:
        x, weights, ids = _inputs(shape, dtype, device, seed=48)
        w = testing.make_expert_inputs(shape, dtype=dtype, device=device, seed=49)
        experts = (w["w_gate"], w["w_up"], w["w_down"])
        out = ep.experts(x, ids, weights, *experts, group=None, num_experts=shape.E, backend=backend)
        ref = moe.fused_experts_reference
        return testing.compare_to_fp64(out, ref(x, weights, ids, *experts),
                                       ref(x.double(), weights.double(), ids, *(t.double() for t in experts)),
                                       dtype)

    return fn


def checks() -> list[Check]:
    """Each check of the ``ep`` family."""
    from glm5_core.conformance import ep_group

    found = list(ep_group.checks())
    for shape in testing.MOE_SHAPES:
        for dtype, tag in DTYPES.items():
            found.append(Check("ep", f"ep_dispatch[{tag}-{shape}-group_None]", ("ep_dispatch",),
                               _dispatch_check(shape, dtype)))
            found.append(Check("ep", f"ep_combine[{tag}-{shape}-group_None]", ("ep_combine",),
                               _combine_check(shape, dtype)))
            found.append(Check("ep", f"ep_experts[{tag}-{shape}-group_None]", ("ep_experts",),
                               _experts_check(shape, dtype)))
    return found


def _dispatch_grad(device: str) -> GradCase:
    x, weights, ids = _inputs(GRAD_SHAPE, torch.float32, device, seed=44)
    E = GRAD_SHAPE.E
    return (lambda be, **t: ep.dispatch(**t, expert_ids=ids, weights=weights, group=None, num_experts=E,
                                        backend=be).rows,
            lambda **t: ep.dispatch_reference(**t, expert_ids=ids, weights=weights, group=None, num_experts=E).rows,
            {"x": x})


def _combine_grad(device: str) -> GradCase:
    x, weights, ids = _inputs(GRAD_SHAPE, torch.float32, device, seed=46)

    def handle(w):
        return ep.dispatch_reference(x, ids, w, group=None, num_experts=GRAD_SHAPE.E)

    rows = handle(weights).rows
    return (lambda be, rows, weights: ep.combine(rows, handle(weights), backend=be),
            lambda rows, weights: ep.combine_reference(rows, weights, handle(weights)),
            {"rows": rows, "weights": weights})


def _experts_grad(device: str) -> GradCase:
    x, weights, ids = _inputs(GRAD_SHAPE, torch.float32, device, seed=50)
    w = testing.make_expert_inputs(GRAD_SHAPE, device=device, seed=51)
    E = GRAD_SHAPE.E
    return (lambda be, **t: ep.experts(**t, expert_ids=ids, group=None, num_experts=E, backend=be),
            lambda **t: ep.experts_reference(**t, expert_ids=ids, group=None, num_experts=E),
            {"x": x, "weights": weights, "w_gate": w["w_gate"], "w_up": w["w_up"], "w_down": w["w_down"]})


GRAD_CASES: dict[str, Callable[[str], GradCase]] = {"ep_dispatch": _dispatch_grad, "ep_combine": _combine_grad,
                                                    "ep_experts": _experts_grad}
