"""The ``gradients`` family: every op declared ``differentiable`` keeps its gradient on every backend, and it
matches the reference's.

The checks follow from the declarations (``OpSpec.differentiable``); their inputs come from the op families'
check modules, each of which gives, for its differentiable ops, ``GRAD_CASES`` (op -> inputs of its backward
check, small odd shapes) and, where it has them, ``GRAD_EDGE_CASES`` ((op, tag, inputs) of extra cases) and
``BF16_GRAD_OPS`` (ops whose backward is also checked with bf16 inputs; the rest take fp32 gradients). The
tables here are their union.
"""
from __future__ import annotations

from typing import Callable

import torch

from glm5_core import registry, testing
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn, GradCase
from glm5_core.conformance.families import family_module, op_families

GRAD_CASES: dict[str, Callable[[str], GradCase]] = {
    op: case for family in op_families() for op, case in getattr(family_module(family), "GRAD_CASES", {}).items()}
GRAD_EDGE_CASES: tuple[tuple[str, str, Callable[[str], GradCase]], ...] = tuple(  # (op, tag, inputs)
    case for family in op_families() for case in getattr(family_module(family), "GRAD_EDGE_CASES", ()))
BF16_GRAD_OPS: tuple[str, ...] = tuple(
    op for family in op_families() for op in getattr(family_module(family), "BF16_GRAD_OPS", ()))


def grad_ops() -> tuple[str, ...]:
    """The ops whose declaration (``OpSpec.differentiable``) says training needs their gradient."""
    return tuple(name for name, spec in registry.op_specs().items() if spec.differentiable)


def _grad_case(op: str, device: str) -> GradCase:
    if op not in GRAD_CASES:
        raise ValueError(f"{op} is declared differentiable but glm5_core.conformance."
                         f"{registry.op_spec(op).family}.GRAD_CASES has no inputs for its backward check; "
                         f"add a case for it")
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


def checks() -> list[Check]:
    checks = []
    for op in grad_ops():
        variants = [("", lambda dev, op=op: _grad_case(op, dev))]
        variants += [(f"{tag}-", case) for case_op, tag, case in GRAD_EDGE_CASES if case_op == op]
        for tag, case in variants:
            for dtype in (torch.float32, torch.bfloat16) if op in BF16_GRAD_OPS else (torch.float32,):
                checks.append(Check("gradients", f"{op}[backward-{tag}{DTYPE_NAMES[dtype]}]", (op,),
                                    _grad_check(op, case, dtype)))
    return checks

