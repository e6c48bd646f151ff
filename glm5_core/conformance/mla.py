"""Conformance checks of the MLA family (``glm5_core.ops.mla``): prefill and decode against the reference, the
expanded and absorbed forms agreeing, and the backward inputs of ``mla_prefill``."""
from __future__ import annotations

from typing import Callable

import torch

from glm5_core import registry, testing
from glm5_core.conformance.check import DTYPE_NAMES, Check, CheckFn, GradCase, fp64
from glm5_core.ops import mla


def _mla_check(op: str, shape: testing.MLAShape, dtype: torch.dtype, start_mode: str) -> CheckFn:
    entry = mla.prefill if op == "mla_prefill" else mla.decode

    def fn(backend: str, device: str) -> testing.Comparison:
        x = testing.make_mla_inputs(shape, dtype=dtype, device=device, seed=1)
        start = testing.start_positions_for(shape.B, shape.T, shape.S, start_mode, device)
        scale = (shape.Dn + shape.Dr) ** -0.5
        out = entry(**x, scale=scale, start_pos=start, backend=backend)
        ref = registry.reference(op)
        return testing.compare_to_fp64(out, ref(**x, scale=scale, start_pos=start),
                                       ref(**fp64(x), scale=scale, start_pos=start), dtype)

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


def checks() -> list[Check]:
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


# --------------------------------------------------------------------------------------------- gradients
_GRAD_SCALE = (testing.MLA_SHAPES[1].Dn + testing.MLA_SHAPES[1].Dr) ** -0.5


def _prefill_grad(device: str) -> GradCase:
    x = testing.make_mla_inputs(testing.MLA_SHAPES[2], device=device, seed=21)  # T == S: a full prefill
    return (lambda be, **t: mla.prefill(**t, scale=_GRAD_SCALE, backend=be),
            lambda **t: mla.prefill_reference(**t, scale=_GRAD_SCALE), x)


# Inputs of the backward check of each differentiable op of the family (see ``gradients.py``).
GRAD_CASES: dict[str, Callable[[str], GradCase]] = {"mla_prefill": _prefill_grad}
