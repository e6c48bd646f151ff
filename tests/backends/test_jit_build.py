"""The native extension cache shared by several source trees (clones, worktrees) and venvs: torch's build
files hold absolute source and torch paths, so one build folder shared between two trees made each rebuild
after the other. A tiny stand-in source goes through the real ``extension.load`` (its ``SOURCE_DIR`` pointed at
a copy per tree), so the build is seconds, not the real extension's minutes."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

STAND_IN = 'extern "C" int glm5_stand_in_answer() { return 42; }\n'

LOAD_TREE = """
import sys
from pathlib import Path
from glm5_core.backends.cpu import extension
extension.SOURCE_DIR = Path(sys.argv[1])
print(extension.load().describe())
"""


def _cannot_build() -> str:
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler"
    if not cpp_extension.is_ninja_available():
        return "no ninja"
    return ""


def _tree(root: Path) -> Path:
    csrc = root / "glm5_core" / "backends" / "cpu" / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "cpu_stand_in.cpp").write_text(STAND_IN)
    return csrc


def _built_files(cache: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.suffix in (".o", ".so")}


def test_two_source_trees_compile_once_and_never_undo_each_other(tmp_path):
    if _cannot_build():
        pytest.skip(_cannot_build())
    first_tree, second_tree = _tree(tmp_path / "clone_a"), _tree(tmp_path / "clone_b")
    cache = tmp_path / "ext"
    env = dict(os.environ, GLM5_EXT_DIR=str(cache), GLM5_SKIP_EXT="0", PYTHONPATH=os.getcwd())

    def load(tree: Path) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-c", LOAD_TREE, str(tree)], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "lacks ops" in result.stdout, result.stdout  # it built and loaded the stand-in
        return result

    first = load(first_tree)
    built = _built_files(cache)
    assert built, "nothing was compiled"
    second, again = load(second_tree), load(first_tree)
    assert _built_files(cache) == built, "a second tree recompiled (or rewrote) what the first had built"
    compiling = [line for line in first.stderr.splitlines() if "compiling the cpu extension" in line]
    assert len(compiling) == 1 and "~3 min" in compiling[0] and "GLM5_SKIP_EXT=1" in compiling[0], first.stderr
    assert "compiling" not in second.stderr + again.stderr, (second.stderr, again.stderr)
