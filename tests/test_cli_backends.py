"""`glm5 backends`: every backend with its status, and ``--backend`` taken like every command takes it."""
import json

from glm5_core import registry
from tests.glm5_command import glm5


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


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_backends_fits_120_columns_with_details_behind_verbose():
    text = glm5("backends").stdout
    assert _widest(text) <= 120, [line for line in text.splitlines() if len(line) > 120][:3]
    for name in registry.backends():
        assert f"\n{name} " in text  # its status row
    for op in registry.OP_NAMES:
        assert f"\n{op} " in text  # its row of the op matrix
    assert "glm5 backends --verbose" in text and "op resolution\nop " not in text  # no per-backend verbose tables
    verbose = glm5("backends", "--verbose").stdout
    assert "why the reference" in verbose and "cpu (tensors on 'cpu'): op resolution" in verbose


def test_the_op_matrix_splits_backend_columns_that_would_not_fit():
    from glm5_core.cli_backends import render_compact

    ops = {op: {"impl": "reference", "reason": "r"} for op in registry.OP_NAMES}
    records = [{"backend": f"vendor{i:02d}", "available": False, "reason": "x " * 200, "device_type": f"dev{i}",
                "dist_backend": "gloo", "ops": ops} for i in range(16)]
    text = render_compact(records)
    assert _widest(text) <= 120 and text.count("\nop ") >= 2
    assert all(f"vendor{i:02d}" in text for i in range(16))


NO_TRITON = """
import sys
sys.modules["triton"] = None  # what a cuda / rocm machine without the extra imports
from glm5_core.cli import main
sys.exit(main(["backends"]))
"""


def test_a_kernel_table_that_needs_a_missing_module_gets_its_install_command():
    import subprocess
    import sys

    from glm5_core.cli_backends import _extras

    proc = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert _widest(text) <= 120
    needing = [name for name in registry.backends()
               if f"{name}: kernel table not loadable here" in text]
    assert needing, text  # the Triton vendors
    for name in needing:
        hint = f"pip install 'glm5-core[{name}]'" if name in _extras() else "pip install triton"
        assert hint in " ".join(text.split()), (name, text)
