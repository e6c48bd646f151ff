"""The suite covers what the ops declare, and (the CI check) ``glm5 conformance`` runs checks of each available
backend's own kernels: here cpu, and cuda / rocm under TRITON_INTERPRET=1 without a GPU. A backend that
quietly became unavailable, or whose every check was skipped or ran the reference, fails here."""
import collections
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from glm5_core import conformance, registry


def test_every_declared_op_is_checked_in_its_family():
    for name, spec in registry.op_specs().items():
        assert spec.family in conformance.FAMILIES, name
        assert any(name in check.ops for check in conformance.checks(spec.family)), name


def test_every_differentiable_op_has_a_gradient_check_and_only_those():
    checked = {check.ops[0] for check in conformance.checks("gradients")}
    assert checked == {name for name, spec in registry.op_specs().items() if spec.differentiable}
    assert checked == set(conformance.GRAD_CASES)


def test_a_differentiable_op_without_gradient_inputs_is_an_error_naming_it(monkeypatch):
    monkeypatch.delitem(conformance.GRAD_CASES, "moe_route")
    check = next(c for c in conformance.checks("gradients") if c.ops == ("moe_route",))
    result = conformance.run_check(check, "cpu")
    assert result.status == "error" and "moe_route is declared differentiable" in result.detail


@pytest.mark.skipif(bool(os.environ.get("GLM5_TEST_BACKENDS") or os.environ.get("GLM5_BACKEND")),
                    reason="the backends under test are named explicitly")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: Triton compiles, no interpreter")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_backends_are_under_test_without_a_gpu():
    for name in ("cuda", "rocm"):
        ok, why = registry.get_backend(name).available()
        assert ok, f"{name} should run under TRITON_INTERPRET=1 here: {why}"


def _cheapest_family_of_own_kernels(backend: str) -> str:
    """The conformance family with the fewest checks among those covering an op ``backend`` has a kernel for."""
    own = [op for op in registry.op_specs() if not registry.runs_reference(op, backend)]
    assert own, f"{backend} runs the reference for every op: nothing of its own to check"
    return min(sorted({registry.op_spec(op).family for op in own}), key=lambda f: len(conformance.checks(f)))


@pytest.mark.slow
def test_glm5_conformance_runs_checks_of_the_backends_own_kernels(backend, tmp_path):
    family = _cheapest_family_of_own_kernels(backend)
    proc = subprocess.run([sys.executable, "-m", "glm5_core.cli", "conformance", "--backend", backend,
                           "--family", family, "--out", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / f"conformance-{backend}.json").read_text())["results"]
    statuses = collections.Counter(r["status"] for r in results)
    assert statuses["pass"] >= 1, f"glm5 conformance --family {family} ran none of {backend}'s kernels: {statuses}"
