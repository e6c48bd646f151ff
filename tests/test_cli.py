"""The `glm5` command: backends table, conformance reports and exit codes, fail-fast on unavailable backends."""
import json
import os
import subprocess
import sys

import pytest
import torch

from glm5_core import conformance, registry


def glm5(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    full_env.pop("GLM5_STRICT", None) if "GLM5_STRICT" not in (env or {}) else None
    return subprocess.run([sys.executable, "-m", "glm5_core.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=900)


def test_backends_lists_every_backend_with_its_status():
    proc = glm5("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    records = {r["backend"]: r for r in json.loads(proc.stdout)}
    for name, be in registry.backends().items():
        ok, reason = be.available()
        assert records[name]["available"] == ok and records[name]["reason"].startswith(reason)
        assert records[name]["dist_backend"] == be.dist_backend
    assert records["cpu"]["available"]
    assert set(records["cpu"]["ops"]) == set(registry.OP_NAMES)
    text = glm5("backends").stdout
    assert "cpu" in text and "dist" in text and "muon_orthogonalize" in text


@pytest.mark.skipif(registry.get_backend("ascend").available()[0], reason="ascend is available here")
def test_unavailable_backend_fails_fast_with_the_reason(tmp_path):
    proc = glm5("conformance", "--backend", "ascend", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "ascend:" in proc.stderr and registry.get_backend("ascend").available()[1] in proc.stderr
    assert not list(tmp_path.iterdir())


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


def test_unknown_command_and_help():
    assert glm5("frobnicate").returncode == 2
    proc = glm5("--help")
    assert proc.returncode == 0 and "conformance" in proc.stdout and "pretrain" in proc.stdout


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


def test_backends_takes_backend_like_every_command():
    proc = glm5("backends", "--json", "--backend", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert [r["backend"] for r in json.loads(proc.stdout)] == ["cpu"]
    ok, reason = registry.get_backend("ascend").available()
    if not ok:
        proc = glm5("backends", "--backend", "ascend")
        assert proc.returncode == 2 and f"ascend: {reason}" in proc.stderr
    proc = glm5("backends", "--backend", "tpu")
    assert proc.returncode == 2 and "backend: expected 'auto' or one of" in proc.stderr


def test_conformance_checks_the_report_folder_before_running(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = glm5("conformance", "--backend", "cpu", "--out", str(blocker / "reports"))
    assert proc.returncode == 2 and "--out" in proc.stderr and "Traceback" not in proc.stderr
    assert "passed" not in proc.stdout  # stopped before the checks


def test_conformance_compares_dispatch_dtypes(monkeypatch):
    """torch.equal ignores dtypes: a dispatch that returns int32 counts must still fail its check."""
    from glm5_core.ops import moe

    def dispatch(x, expert_ids, *, num_experts):
        x_sorted, sort_idx, counts = moe.dispatch_reference(x, expert_ids, num_experts=num_experts)
        return x_sorted, sort_idx, counts.to(torch.int32)

    known = registry.backends()
    fake = registry.Backend(name="int32counts", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "test"),
                            kernel_table=lambda: {"moe_dispatch": dispatch})
    monkeypatch.setattr(registry, "_discover", lambda: {**known, "int32counts": fake})
    try:
        results = [conformance.run_check(c, "int32counts") for c in conformance.checks("moe") if "dispatch" in c.name]
    finally:
        registry._kernel_table.cache_clear()
    assert results and all(r.status == "fail" and "counts is torch.int32" in r.detail for r in results)
