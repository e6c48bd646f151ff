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


def test_the_stage_starts_where_the_config_puts_it(bench, base_tree, tmp_path, monkeypatch):
    """The stage's first step comes from the config's stages (it was configs/tiny.yaml's 0 / 300 / 360 for every
    config: --config configs/small.yaml sparse timed dense steps, labelled sparse); --steps past the stage exit 2."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / "configs" / "tiny.yaml").read_text()
    head, rest = text.split("stages:\n", 1)
    tail = rest[rest.index("loss:"):]
    stages = ("  - {kind: dense, steps: 2}\n  - {kind: indexer_warmup, steps: 5, indexer_lr: 5.0e-3, "
              "indexer_final_lr: 2.0e-4}\n"
              "  - {kind: sparse, steps: 5}\n")
    config = tmp_path / "short.yaml"
    config.write_text(head + "stages:\n" + stages + tail)
    out = tmp_path / "r.json"
    assert bench.main(["sparse", "--base-tree", str(base_tree), "--steps", "1", "--config", str(config),
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["first_step"] == 7 and result["stage_labels"] == ["sparse"] and result["metrics_identical"]


def test_steps_past_the_stage_exit_2(bench, capsys, base_tree, monkeypatch):
    monkeypatch.chdir(ROOT)
    exits_2_naming(bench, capsys, ["indexer_warmup", "--base-tree", str(base_tree), "--steps", "58"], "--steps")
