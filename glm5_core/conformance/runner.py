"""Running a check: :func:`run_check` gives its :class:`~glm5_core.conformance.check.Result`, reporting ops that ran
the reference (no kernel, or a kernel that declined the check's calls) as ``fallback`` (``fail`` in strict mode);
:func:`assert_conforms` is its pytest form."""
from __future__ import annotations

import time
import traceback

from glm5_core import registry
from glm5_core.conformance.check import Check, NotRunnable, Result


def _fell_back(op: str, backend: str, declined: dict[str, str]) -> bool:
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
    except NotRunnable as exc:
        return Result(check.family, check.name, list(check.ops), "not_run", None, None, str(exc),
                      time.perf_counter() - start)
    except Exception as exc:  # a crashing kernel is a failed check, with its traceback in the report
        tb = traceback.format_exc(limit=4)
        return Result(check.family, check.name, list(check.ops), "error", None, None, f"{exc!r}\n{tb}",
                      time.perf_counter() - start)



def assert_conforms(backend: str, check: Check) -> None:
    """pytest form of :func:`run_check`: skip checks that would compare the reference with itself."""
    import pytest

    fallbacks = [op for op in check.ops if registry.runs_reference(op, backend)]
    if check.against_reference and len(fallbacks) == len(check.ops):
        pytest.skip(f"{backend} runs the reference for {', '.join(check.ops)} (the spec is tested in tests/ops)")
    result = run_check(check, backend)
    if result.status == "not_run":
        pytest.skip(f"{check.name} on {backend}: {result.detail}")
    assert result.status in ("pass", "fallback"), f"{check.name} on {backend}: {result.status}: {result.detail}"
