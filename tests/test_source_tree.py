"""glm5-core runs from a clone without `pip install`: every vendor is a folder inside the package, discovered from
the folders (entry points are for out-of-tree vendors), and no ``package_dir`` mapping hides a sub-package."""
import os
import subprocess
import sys
from pathlib import Path

from glm5_core import registry

REPO = Path(__file__).resolve().parents[1]

# Runs `glm5_core.cli backends` with the installed copy (an editable finder or site-packages) taken out of the
# import system, so only the source tree on PYTHONPATH can provide glm5_core.
_SOURCE_ONLY = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
import glm5_core, glm5_core.backends.cpu
assert glm5_core.__file__.startswith(sys.argv[1]), glm5_core.__file__
sys.argv = ["glm5", "backends"]
runpy.run_module("glm5_core.cli", run_name="__main__")
"""


def test_the_cli_runs_from_a_source_tree_on_pythonpath():
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLM5_SKIP_EXT": "1"}
    proc = subprocess.run([sys.executable, "-c", _SOURCE_ONLY, str(REPO)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("cpu", "cuda", "rocm", "ascend"):
        assert name in proc.stdout


def test_builtin_backends_are_found_from_their_folders_without_entry_points(monkeypatch):
    monkeypatch.setattr(registry, "_entry_points", lambda: [])
    registry.reset()
    try:
        names = set(registry.backends())
    finally:
        registry.reset()
    folders = {p.parent.name for p in (REPO / "glm5_core" / "backends").glob("*/backend.py")}
    assert names == folders and {"cpu", "cuda", "rocm", "ascend"} <= names


def test_no_vendor_folder_is_left_outside_the_package():
    assert not (REPO / "backends").exists() and not (REPO / "csrc").exists()
    assert "package_dir" not in (REPO / "setup.py").read_text()
    native = {p.parent.parent.name for p in (REPO / "glm5_core" / "backends").glob("*/csrc/*") if p.is_file()}
    assert native == {"cpu"}
