"""Which checkpoint folders a run keeps and which one it resumes from: chosen by this run's write history
(``latest``), never by name; a re-written step is never missing; what a killed writer left is recovered or
removed at the next start, whatever its PID."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_core.train import RunOptions, parse_config, pretrain
from glm5_core.train.checkpoint import resolve_checkpoint

FILES = ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json"]


def read_history(root: Path):
    """The folder names `latest` lists, newest first."""
    return (root / "latest").read_text().split()


def is_complete(folder: Path) -> bool:
    return folder.is_dir() and sorted(p.name for p in folder.iterdir()) == FILES


def _steps(root: Path):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def _run(raw, out, **options):
    return pretrain(parse_config(raw), RunOptions(backend="cpu", output_dir=str(out), **options))


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def every_step(small_raw):
    small_raw["checkpoint"] = {"every_steps": 1, "keep_last": 2}
    return small_raw


def test_a_fresh_run_into_a_folder_of_a_longer_run_keeps_its_checkpoints(every_step, tmp_path):
    out = tmp_path / "run"
    _run(every_step, out)  # the earlier run: steps 1..6, keeps step_5 and step_6
    root = out / "checkpoints"
    assert _steps(root) == ["step_00000005", "step_00000006"]
    _run(every_step, out, max_steps=3)  # a fresh run into the same folder (the default config reuses it)
    assert read_history(root) == ["step_00000003", "step_00000002"]
    assert _steps(root) == ["step_00000002", "step_00000003", "step_00000005", "step_00000006"]
    assert resolve_checkpoint(out).name == "step_00000003"
    summary = _run(every_step, out, resume=str(out), max_steps=4)
    assert summary["steps"] == [3, 4]
    assert read_history(root) == ["step_00000004", "step_00000003"]  # step_00000002 pruned: this run's, older


def test_a_resume_from_an_older_checkpoint_keeps_what_it_writes(small_raw, tmp_path):
    small_raw["checkpoint"] = {"every_steps": 2, "keep_last": 3}
    out = tmp_path / "run"
    _run(small_raw, out)  # step_2, step_4, step_6
    root = out / "checkpoints"
    small_raw["checkpoint"] = {"every_steps": 1, "keep_last": 2}
    _run(small_raw, out, resume=str(root / "step_00000002"), max_steps=3)
    # sorting by name kept step_4 and step_6 and deleted the step_3 `latest` names
    assert resolve_checkpoint(out).name == "step_00000003" and is_complete(root / "step_00000003")
    assert read_history(root) == ["step_00000003", "step_00000002"]
    assert "step_00000004" in _steps(root) and "step_00000006" in _steps(root)  # written after step_2: not ours
    assert _run(small_raw, out, resume=str(out))["steps"] == [3, 6]


def test_rewriting_the_latest_step_resumes_after_a_kill_between_set_aside_and_rename(every_step, tmp_path):
    """What 231de35 left after a kill between removing the old step_N and renaming the new one in: `latest`
    names a folder that does not exist, the complete new data in a temporary folder."""
    out = tmp_path / "run"
    _run(every_step, out, max_steps=3)
    root = out / "checkpoints"
    pid = _dead_pid()
    os.rename(root / "step_00000003", root / f".tmp-step_00000003-{pid}")
    summary = _run(every_step, out, resume=str(out))
    assert summary["steps"] == [3, 6]  # the temporary folder was put in place and resumed from, not refused
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_a_set_aside_old_step_goes_back_when_the_new_one_never_finished(every_step, tmp_path):
    from glm5_core.train.checkpoint_folders import recover

    out = tmp_path / "run"
    _run(every_step, out, max_steps=3)
    root = out / "checkpoints"
    pid = _dead_pid()
    os.rename(root / "step_00000003", root / f".old-step_00000003-{pid}")
    (root / f".tmp-step_00000003-{pid}").mkdir()  # its replacement, half written
    (root / f".tmp-step_00000003-{pid}" / "model.safetensors").write_bytes(b"partial")
    messages = []
    recover(root, log=messages.append)
    assert is_complete(root / "step_00000003") and _steps(root) == ["step_00000002", "step_00000003"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert len(messages) == 2 and "restored it from .old-step_00000003" in messages[0]


def test_resume_falls_back_to_the_newest_complete_checkpoint_and_says_so(every_step, tmp_path, capsys):
    out = tmp_path / "run"
    _run(every_step, out, max_steps=3)
    root = out / "checkpoints"
    (root / "step_00000003" / "optimizer.safetensors").unlink()  # incomplete
    capsys.readouterr()
    summary = _run(every_step, out, resume=str(out))
    assert summary["steps"] == [2, 6]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("resume:")]
    assert lines == [f"resume: {root / 'latest'} names step_00000003, which is missing or incomplete; resuming "
                     f"from step_00000002, the newest complete checkpoint"]


def test_resume_with_no_complete_checkpoint_is_one_clear_error(every_step, tmp_path):
    out = tmp_path / "run"
    _run(every_step, out, max_steps=1)
    root = out / "checkpoints"
    (root / "step_00000001" / "rng.safetensors").unlink()
    with pytest.raises(ValueError, match=r"names 'step_00000001', which is missing or incomplete, and .* holds no "
                                         r"complete checkpoint"):
        resolve_checkpoint(out)


def test_orphaned_temporary_folders_are_removed_at_start_whatever_their_pid(every_step, tmp_path):
    out = tmp_path / "run"
    root = out / "checkpoints"
    root.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        orphans = [root / f".tmp-step_00000004-{_dead_pid()}", root / f".tmp-step_00000002-{os.getpid()}"]
        running = root / f".tmp-step_00000009-{live.pid}"  # a live writer's: left alone
        for folder in [*orphans, running]:
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"\0" * 4096)
        (root / f".latest.tmp-{_dead_pid()}").write_text("step_00000004\n")
        _run(every_step, out, max_steps=1)
        left = sorted(p.name for p in root.iterdir())
        assert left == [running.name, "latest", "step_00000001"]
    finally:
        live.kill()
        live.wait()


def test_a_latest_naming_a_link_to_a_folder_elsewhere_is_refused(every_step, tmp_path):
    out = tmp_path / "run"
    _run(every_step, out, max_steps=1)
    elsewhere = tmp_path / "elsewhere"
    os.rename(out / "checkpoints" / "step_00000001", elsewhere)
    os.symlink(elsewhere, out / "checkpoints" / "step_00000001")
    with pytest.raises(ValueError, match=r"names step_00000001, a link to .*elsewhere; expected a checkpoint folder "
                                         r"inside"):
        _run(every_step, tmp_path / "other", resume=str(out))


@pytest.mark.parametrize("text, message", [
    ("../../etc\n", r"expected checkpoint folder names \(step_<digits>\), one a line; got '\.\./\.\./etc'"),
    ("", r"got ''"),
    ("\xff\xfe", r"got binary data"),
])
def test_a_malformed_latest_is_named(tmp_path, text, message):
    (tmp_path / "latest").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=message):
        resolve_checkpoint(tmp_path)
