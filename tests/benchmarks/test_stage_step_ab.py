"""benchmarks/stage_step_ab.py: bad flags exit 2 naming the flag; "old" steps really run the base tree's code of a
swapped function; a run against an identical base reports identical metrics and writes its JSON."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.benchmarks.bench_scripts import exits_2_naming

SCRIPT = "stage_step_ab"  # what the bench fixture loads
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def base_tree(tmp_path):
    """A base tree: a copy of this tree's glm5_core/ops/_checks.py (what the tests swap)."""
    (tmp_path / "glm5_core" / "ops").mkdir(parents=True)
    shutil.copy(ROOT / "glm5_core" / "ops" / "_checks.py", tmp_path / "glm5_core" / "ops" / "_checks.py")
    return tmp_path


@pytest.fixture(autouse=True)
def _one_thread_kept(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)


@pytest.mark.parametrize("flags, named", [(["--steps", "0"], "--steps"),
                                          (["--swap", "glm5_core.ops._checks"], "--swap"),
                                          (["--swap", "glm5_core.nowhere:f"], "--swap"),
                                          (["--base-extension"], "--base-extension")])  # no csrc in the base
def test_a_bad_flag_exits_2_naming_it(bench, capsys, base_tree, flags, named):
    exits_2_naming(bench, capsys, ["dense", "--base-tree", str(base_tree)] + flags, named)


def test_a_base_tree_without_glm5_core_exits_2(bench, capsys, tmp_path):
    exits_2_naming(bench, capsys, ["dense", "--base-tree", str(tmp_path)], "--base-tree")


def test_old_steps_run_the_base_code(bench, base_tree, monkeypatch):
    monkeypatch.chdir(ROOT)
    checks = base_tree / "glm5_core" / "ops" / "_checks.py"
    docstring = '    """Reject NaN / inf where they would silently corrupt a selection.'
    raising = '    raise RuntimeError("the base finite ran")\n'
    checks.write_text(checks.read_text().replace(docstring, raising + docstring, 1))
    from glm5_core.ops import _checks

    code = _checks.finite.__code__
    with pytest.raises(RuntimeError, match="the base finite ran"):
        bench.main(["dense", "--base-tree", str(base_tree), "--steps", "1", "--swap", "glm5_core.ops._checks:finite"])
    assert _checks.finite.__code__ is code  # this tree's code is back after the failed run


def test_an_identical_base_gives_identical_metrics(bench, base_tree, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "r.json"
    assert bench.main(["indexer_warmup", "--base-tree", str(base_tree), "--steps", "1", "--swap",
                       "glm5_core.ops._checks:finite", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["metrics_identical"] and result["stage"] == "indexer_warmup" and result["old_ms"] > 0
