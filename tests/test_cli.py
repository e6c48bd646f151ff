"""The `glm5` command: backends table, conformance reports and exit codes, fail-fast on unavailable backends."""
import json
import os
import subprocess
import sys

import pytest

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
