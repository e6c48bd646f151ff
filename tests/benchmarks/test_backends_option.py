"""``pytest benchmarks --backends ...`` (benchmarks/conftest.py, benchmarks/_backends.py) and ``benchmarks/render.py``
over the JSON of a real, short pytest-benchmark run (``GLM5_BENCH_TINY=1``, the native extension not built)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_core import registry
from tests.benchmarks.bench_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
MUON = "benchmarks/bench_muon.py"
GROUP = "muon tiny-config matrices (4 matrices, 5 steps, jordan) [cpu]"


def bench_pytest(*args, env=None):
    """``python -m pytest ARGS`` on the benchmarks, as a user runs them from the repository root (this tree's
    glm5_core first on the path; no Triton interpreter, no native build, the tiny sizes)."""
    full = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GLM5_BENCH_BACKENDS")}
    full.update(GLM5_SKIP_EXT="1", GLM5_BENCH_TINY="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), **(env or {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, env=full, timeout=600)


def unavailable_backend() -> str:
    """A backend that cannot run here (ascend without torch_npu), with its reason."""
    ok, _ = registry.get_backend("ascend").available()
    if ok:
        pytest.skip("ascend is available here: no backend to show skipped")
    return "ascend"


def test_the_option_times_each_requested_backend_beside_the_reference_and_render_reads_the_run(tmp_path, capsys):
    missing = unavailable_backend()
    out = tmp_path / "bench.json"
    run = bench_pytest(MUON, "-k", "tiny_model_matrices and fp32", "-v", "-rs",
                       "--backends", f"cpu,reference,{missing}", "--benchmark-json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reason = registry.get_backend(missing).available()[1]
    # every requested backend is a case: the cpu's (its kernel not built here: skipped saying so), the missing one
    # skipped with its own reason; the reference and the peer beside them
    assert f"test_tiny_model_matrices[{missing}@" in run.stdout and "test_tiny_model_matrices[cpu-fp32]" in run.stdout
    skipped = [line.split(": ", 1)[1] for line in run.stdout.splitlines() if line.startswith("SKIPPED [1]")]
    assert f"{missing}: {reason}" in skipped, run.stdout
    assert [s for s in skipped if s.startswith("cpu: muon_orthogonalize runs the reference here")], run.stdout
    timed = {b["name"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert set(timed) == {"test_tiny_model_matrices[reference-fp32]", "test_tiny_model_matrices[torch_muon_loop-fp32]"}
    assert {b["group"] for b in timed.values()} == {GROUP}

    render = load_benchmark(pytest.MonkeyPatch(), "render")
    assert render.main([str(out), "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    ref = timed["test_tiny_model_matrices[reference-fp32]"]["stats"]["median"]
    peer = timed["test_tiny_model_matrices[torch_muon_loop-fp32]"]["stats"]["median"]
    assert f"| {GROUP} | {ref * 1e3:.2f} | torch_muon_loop {ref / peer:.2f}x |" in printed, printed
    assert (tmp_path / "report.md").read_text() in printed
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_environment_variable_picks_the_backends_too():
    run = bench_pytest(MUON, "--collect-only", "-q", "-k", "tiny_model_matrices",
                       env={"GLM5_BENCH_BACKENDS": "reference"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ids = sorted(line.split("[")[1].rstrip("]") for line in run.stdout.splitlines() if "::" in line)
    assert ids == ["reference-bf16", "reference-fp32", "torch_muon_loop-bf16", "torch_muon_loop-fp32"]


def test_an_unknown_backend_is_one_line_with_did_you_mean():
    run = bench_pytest(MUON, "--collect-only", "-q", "--backends", "cpu,cdua")
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 4 and len(lines) == 1, (run.returncode, lines)
    assert lines[0].startswith("ERROR: --backends: expected 'all' or a comma-separated list of reference, cpu")
    assert lines[0].endswith("got 'cdua'; did you mean 'cuda'?")


def test_cases_per_device_and_all_leaves_out_emulated_backends(monkeypatch):
    backends = load_benchmark(monkeypatch, "_backends")
    missing = unavailable_backend()
    cases = backends.impls(["cpu", "reference", missing], peers=("peer",))
    shown = [(impl.id, impl.kind, why) for impl, why in cases]
    why = f"{missing}: {registry.get_backend(missing).available()[1]}"
    device = registry.get_backend(missing).device_type
    assert shown == [("reference", "reference", None), ("peer", "peer", None), ("cpu", "backend", None),
                     (f"{missing}@{device}", "backend", why)]
    assert [impl.id for impl, _ in backends.impls(["reference"], peers=("peer",))] == ["reference", "peer"]
    every = backends.parse_request("all")
    assert every[0] == "reference" and "cpu" in every and missing not in every
    for name, backend in registry.backends().items():  # here (tests' conftest): cuda / rocm under the interpreter
        if backend.available()[0] and backend.device() != backend.device_type:
            assert name not in every and backends.parse_request(name) == [name]


def test_an_unknown_backend_from_the_environment_names_the_variable(monkeypatch):
    conftest = load_benchmark(monkeypatch, "conftest")

    class Config:
        def getoption(self, name):
            return None

    monkeypatch.setenv("GLM5_BENCH_BACKENDS", "reference,cpu,rcom")
    pattern = r"^GLM5_BENCH_BACKENDS: expected .* got 'rcom'; did you mean 'rocm'\?$"
    with pytest.raises(pytest.UsageError, match=pattern):
        conftest.requested_backends(Config())
    monkeypatch.setenv("GLM5_BENCH_BACKENDS", "reference, cpu")
    assert conftest.requested_backends(Config()) == ["reference", "cpu"]
