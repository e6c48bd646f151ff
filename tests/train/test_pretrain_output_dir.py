"""``glm5 pretrain`` without --resume refuses a folder that is not empty (one line, exit 2), as ``glm5 rl`` does:
a second run there would overwrite the first run's final/, summary.json and metrics.jsonl."""
import json

import yaml

from glm5_core.cli import main
from glm5_core.train import cli as pretrain_cli


def _must_not_run(*args, **kwargs):
    raise AssertionError("pretrain ran")


def _config(small_raw, tmp_path):
    small_raw["stages"] = [dict(kind="dense", steps=1)]
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small_raw))
    return ["pretrain", "--config", str(path), "--backend", "cpu", "--output-dir", str(tmp_path / "run")]


def test_a_second_run_into_the_same_folder_is_refused_and_changes_nothing(small_raw, tmp_path, capsys):
    args = _config(small_raw, tmp_path)
    run = tmp_path / "run"
    assert main(args) == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"glm5 pretrain: error: output_dir: {str(run)!r} already holds an earlier run; continue it with "
                   f"--resume {run}, or pick a new or empty folder")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert main(args + ["--resume"]) == 0  # the opt-in: continue the run there
    assert json.loads((run / "summary.json").read_text())["steps"] == [1, 1]


def test_a_folder_holding_other_files_is_refused_before_anything_is_built(small_raw, tmp_path, capsys, monkeypatch):
    args = _config(small_raw, tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    monkeypatch.setattr("glm5_core.train.trainer.pretrain", _must_not_run)
    assert main(args) == 2
    assert "already holds 1 entries (notes.txt); continue it with --resume" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]


def test_an_empty_folder_is_a_fresh_run_and_only_rank_0_checks(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    pretrain_cli.check_fresh_output_dir(str(tmp_path / "empty"))
    pretrain_cli.check_fresh_output_dir(str(tmp_path / "missing"))
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    monkeypatch.setenv("RANK", "1")  # rank 0 may already have written there: only it decides
    pretrain_cli.check_fresh_output_dir(str(tmp_path / "empty"))


def test_the_progress_bar_shows_the_smoothed_lm_loss_the_summary_ends_on(small_raw, tmp_path, capsys):
    """The bar once showed ``loss=``, the step's total loss (LM + MTP + KL; the KL alone in a warm-up): the
    Quickstart's bar ended on loss=4.352 while the summary said 1.958."""
    small_raw["logging"]["progress_bar"] = True
    small_raw["stages"] = [dict(kind="dense", steps=3)]
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small_raw))
    assert main(["pretrain", "--config", str(path), "--backend", "cpu", "--output-dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert f"lm_loss_mean50={summary['last_lm_loss']:.3f}" in err, err
    assert " loss=" not in err and ",loss=" not in err, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and f"{records[-1]['lm_loss']:.3f}" != f"{summary['last_lm_loss']:.3f}"  # smoothed


def test_a_warmup_before_any_lm_step_shows_the_indexer_kl_by_name():
    from glm5_core.train.trainer import bar_postfix

    assert bar_postfix({"stage": "indexer_warmup", "loss": 0.7, "indexer_kl": 0.35}, []) == \
        {"stage": "indexer_warmup", "indexer_kl": "0.350"}
    assert bar_postfix({"stage": "sparse", "loss": 9.0, "lm_loss": 3.0}, [1.0, 2.0, 3.0]) == \
        {"stage": "sparse", "lm_loss_mean50": "2.000"}


def test_resume_path_continues_in_that_run_folder_not_the_configs(small_raw, tmp_path, capsys):
    """``--resume runs/ep2`` with a config whose output_dir holds another run (docs/expert-parallel.md's second
    command after the Quickstart: output_dir runs/tiny) used to write the resumed run into the config's folder,
    overwriting the run there; it continues in runs/ep2, and an explicit other --output-dir that is not empty is
    refused."""
    small_raw["stages"] = [dict(kind="dense", steps=2)]
    small_raw["output_dir"] = str(tmp_path / "quickstart")
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(small_raw))
    base = ["pretrain", "--config", str(config), "--backend", "cpu"]
    assert main(base) == 0  # the config's own run
    quickstart = tmp_path / "quickstart"
    before = {p.relative_to(quickstart): p.read_bytes() for p in quickstart.rglob("*") if p.is_file()}
    other = tmp_path / "other"
    assert main(base + ["--output-dir", str(other), "--max-steps", "1"]) == 0
    capsys.readouterr()
    assert main(base + ["--resume", str(other)]) == 0
    assert json.loads((other / "summary.json").read_text())["steps"][-1] == 2  # it went on in its own folder
    assert {p.relative_to(quickstart): p.read_bytes() for p in quickstart.rglob("*") if p.is_file()} == before
    capsys.readouterr()
    assert main(base + ["--resume", str(other), "--output-dir", str(quickstart)]) == 2
    assert "already holds an earlier run" in capsys.readouterr().err
