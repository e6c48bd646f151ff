"""`glm5 conformance` (``glm5_core.conformance.cli``): the reports and exit codes, strict mode, a wrong or declining
vendor kernel; and (the CI check) that it runs checks of each available backend's own kernels: here cpu, and
cuda / rocm under TRITON_INTERPRET=1 without a GPU. A backend that quietly became unavailable, or whose every
check was skipped or ran the reference, fails here."""
import collections
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from glm5_core import conformance, registry
from tests.glm5_command import glm5


def test_conformance_cpu_passes_and_writes_both_reports(tmp_path):
    proc = glm5("conformance", "--backend", "cpu", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "conformance-cpu.json").read_text())
    assert report["summary"]["fail"] == 0 and report["summary"]["error"] == 0
    assert len(report["results"]) == len(conformance.checks())
    markdown = (tmp_path / "conformance-cpu.md").read_text()
    assert markdown.startswith("# glm5-core conformance report: `cpu`")
    assert "## determinism" in markdown and "topk_prefill_decode" in markdown


def test_strict_conformance_fails_and_names_the_missing_op(tmp_path):
    missing = registry.missing_ops("cpu")
    if not missing:
        pytest.skip("cpu implements every op natively")
    family = next(f for f in conformance.FAMILIES if any(missing[0] in c.ops for c in conformance.checks(f)))
    proc = glm5("conformance", "--backend", "cpu", "--family", family, "--out", str(tmp_path),
                env={"GLM5_STRICT": "1"})
    assert proc.returncode == 1
    assert missing[0] in proc.stdout and "GLM5_STRICT" in proc.stdout


def _vendor_plugin(tmp_path, kernel_body, supports="lambda G, **kw: (True, '')"):
    """A third-party backend 'vendorq' whose Muon kernel is ``kernel_body`` (G, steps, coefficients,
    compute_dtype in scope)."""
    (tmp_path / "vendorq.py").write_text(
        "import torch\n"
        "from glm5_core.registry import Backend\n"
        "from glm5_core.ops.muon import orthogonalize_reference\n\n"
        "def orthogonalize(G, *, steps, coefficients, compute_dtype=torch.float32):\n"
        f"    return {kernel_body}\n\n"
        f"orthogonalize.supports = {supports}\n"
        "BACKEND = Backend(name='vendorq', device_type='cpu', dist_backend='gloo', probe=lambda: (True, 'simulated'),\n"
        "                  kernel_table=lambda: {'muon_orthogonalize': orthogonalize})\n")
    dist = tmp_path / "vendorq-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vendorq\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[glm5_core.backends]\nvendorq = vendorq:BACKEND\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}


MUON_REF = "orthogonalize_reference(G, steps=steps, coefficients=coefficients, compute_dtype=compute_dtype)"


@pytest.mark.parametrize("kernel_body,symptom,failing", [
    (f"{MUON_REF} * 1.001", "max |out - fp64 ref|", "fp32"),  # 0.1% off: an fp32 error
    ("orthogonalize_reference(G.float(), steps=steps, coefficients=coefficients, compute_dtype=compute_dtype)",
     "dtype", "bf16"),  # fp32 out
], ids=("scaled", "wrong_dtype"))
def test_conformance_fails_when_a_vendor_kernel_is_wrong(tmp_path, kernel_body, symptom, failing):
    env = _vendor_plugin(tmp_path, kernel_body)
    proc = glm5("conformance", "--backend", "vendorq", "--family", "muon", "--out", str(tmp_path / "r"), env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAIL muon_orthogonalize[{failing}" in proc.stdout and symptom in proc.stdout
    report = json.loads((tmp_path / "r" / "conformance-vendorq.json").read_text())
    failed = {r["check"] for r in report["results"] if r["status"] == "fail"}
    # (a 0.1% scaling is well inside bf16 compute's own error, so the bf16-compute checks pass it)
    assert {c.name for c in conformance.checks("muon") if failing in c.name and "bf16_compute" not in c.name} <= failed


def test_conformance_reports_checks_the_kernel_declined_as_fallbacks(tmp_path):
    """A kernel that declines a call did not pass it: the reference ran, and the report says so."""
    env = _vendor_plugin(tmp_path, MUON_REF, supports="lambda G, **kw: (G.dtype == torch.float32, 'fp32 only')")
    proc = glm5("conformance", "--backend", "vendorq", "--family", "muon", "--out", str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "conformance-vendorq.json").read_text())["results"]
    for r in results:
        declined = "fp32" not in r["check"]
        assert r["status"] == ("fallback" if declined else "pass"), r
        assert ("fp32 only" in r["detail"]) == declined, r
    proc = glm5("conformance", "--backend", "vendorq", "--family", "muon", "--out", str(tmp_path),
                env={**env, "GLM5_STRICT": "1"})
    assert proc.returncode == 1 and "fp32 only" in proc.stdout


def test_conformance_checks_the_report_folder_before_running(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = glm5("conformance", "--backend", "cpu", "--out", str(blocker / "reports"))
    assert proc.returncode == 2 and "--out" in proc.stderr and "Traceback" not in proc.stderr
    assert "passed" not in proc.stdout  # stopped before the checks


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



class _Stream:
    """A text stream that says whether it is a terminal."""

    def __init__(self, tty: bool):
        self.tty, self.parts = tty, []

    def write(self, text):
        self.parts.append(text)
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return self.tty

    def text(self):
        return "".join(self.parts)


def test_conformance_progress_is_a_line_per_family_in_a_log_and_a_bar_on_a_terminal():
    """`glm5 conformance` printed nothing for minutes: now each family says when it is done (the only progress
    a log gets), and a terminal sees the family and check running."""
    from glm5_core.conformance.cli import run_with_progress

    families = ["ep", "muon"]
    log = _Stream(tty=False)
    results = run_with_progress(families, "cpu", stream=log)
    lines = log.text().splitlines()
    assert len(lines) == 2, lines
    for family, line in zip(families, lines):
        n = len(conformance.checks(family))
        assert line.startswith(f"conformance[cpu] {family}: {n} checks, ") and " failed" in line, line
    assert len(results) == sum(len(conformance.checks(f)) for f in families)
    terminal = _Stream(tty=True)
    run_with_progress(["ep"], "cpu", stream=terminal)
    shown = terminal.text()
    assert f"ep: {conformance.checks('ep')[0].name}" in shown and "conformance[cpu] ep: " in shown
