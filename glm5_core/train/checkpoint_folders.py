"""Checkpoint folders of a training run: how a written one is published, which ones are kept, which one a
resume takes, and what a killed writer left behind.

Inside a checkpoints root (``<output_dir>/checkpoints``):
  step_00000042/            a complete checkpoint (its files: see ``checkpoint.py``)
  latest                    this run's checkpoints, newest first, one folder name a line; the first is the
                            one a resume takes ("the one ``latest`` names")
  .tmp-step_00000042-PID/   a checkpoint process PID is writing
  .old-step_00000042-PID/   the previous step_00000042, set aside while process PID replaces it
  .latest.tmp-PID           the next ``latest``, being written

:func:`publish` moves a fully written (and fsynced) temporary folder into place:
  1. rename ``step_N``, if there is one, to ``.old-step_N-PID``
  2. rename ``.tmp-step_N-PID`` to ``step_N``
  3. replace ``latest`` atomically: ``step_N``, then the run's earlier checkpoints, cut to ``keep_last``
  4. delete ``.old-step_N-PID``, then the checkpoints cut from the history
So the folder ``latest`` names is complete at every moment, except after a kill between 1 and 2, when it
lies aside with the complete new data in ``.tmp-``: a resume then reads that (:func:`resolve_checkpoint`), and
:func:`recover` puts it in place. ``recover`` runs on the writing rank at the start of every run and before
every write, and also removes what stopped writers left (half-written ``.tmp-`` folders, set-aside folders,
``.latest.tmp-`` files), whatever their PID: the writer's own PID counts as stopped there (it is not writing
yet, and in a container a restarted run often has the same PID). A folder ``latest`` names that is missing
or incomplete otherwise (deleted files) is replaced by the newest complete one, and the resume says so.

Kept by write history, never by name: a fresh run into a folder holding an earlier run's step_00000900
writes step_00000100 and keeps it (sorting names would delete it at once). Pruning deletes only checkpoints
of *this run's* history, never the newest; an earlier run's checkpoints stay until one of the same name
replaces them. A run resumed from a checkpoint of its own root continues that checkpoint's history (the
checkpoints written up to it; after a resume from an older checkpoint, the ones written after it are left).
One writer per root: two live runs writing into one root are not supported.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Optional

from glm5_core.safe_files import read_bytes, read_json

LATEST = "latest"
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json")
SHARDED_FILES = ("dcp", "rng.safetensors", "trainer_state.json")  # train/dcp_checkpoint.py's layout
MAX_LATEST_BYTES = 1024 * 1024
MAX_STATE_BYTES = 16 * 1024 * 1024  # trainer_state.json: a step, a data position, 625 Python RNG words
_STEP = re.compile(r"step_\d{8,12}")
_LEFTOVER = re.compile(r"\.(tmp|old)-(step_\d{8,12})-(\d{1,10})")
_LATEST_TMP = re.compile(r"\.latest\.tmp-(\d{1,10})")

Log = Callable[[str], None]
Stage = Optional[Callable[[str], None]]  # called with each stage's name before it runs (tests kill there)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def folder_name(step: int) -> str:
    return f"step_{step:08d}"


def temp_folder(root: Path, step: int) -> Path:
    return root / f".tmp-{folder_name(step)}-{os.getpid()}"


def is_complete(folder: Path) -> bool:
    """A real folder (not a link to one elsewhere) holding every checkpoint file (their contents are checked
    when loaded)."""
    return folder.is_dir() and not folder.is_symlink() and (all(os.path.lexists(folder / f) for f in FILES) or
                                                            all(os.path.lexists(folder / f) for f in SHARDED_FILES))


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: so a rename or a new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a folder, file or link (a link only: never what it points to)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) if path.is_dir() else 0


def _writer_running(pid: int) -> bool:
    """Whether another live process has this PID (this process counts as not running: see the docstring)."""
    if pid == os.getpid() or pid <= 0:
        return False
    if os.name == "nt":  # os.kill(pid, 0) would terminate it there: assume it runs, remove nothing of it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except (OverflowError, OSError):
        return False
    return True


# ---------------------------------------------------------------------------------- history


def read_history(root: Path) -> list[str]:
    """The folder names ``root/latest`` lists, newest first ([] without the file). ValueError naming the file
    when it holds anything but checkpoint folder names."""
    path = root / LATEST
    if not os.path.lexists(path):
        return []
    try:
        text = read_bytes(path, root=root, max_bytes=MAX_LATEST_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: expected checkpoint folder names (step_<digits>), one a line; got binary data") \
            from None
    names = text.split()
    bad = [name for name in names if not _STEP.fullmatch(name)]
    if bad or not names:
        shown = bad[0] if bad else text
        raise ValueError(f"{path}: expected checkpoint folder names (step_<digits>), one a line; got {shown[:80]!r}")
    return list(dict.fromkeys(names))


def _write_latest(root: Path, names: Sequence[str]) -> None:
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(f"{name}\n" for name in names))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def lineage(root: Path, folder: Path) -> list[str]:
    """The history a run resumed from ``folder`` continues in ``root``: ``folder`` and the checkpoints written
    before it, when ``folder`` is in ``root``; [] for a checkpoint elsewhere (that run's folders are not ours)."""
    if not root.is_dir() or os.path.realpath(folder.parent) != os.path.realpath(root):
        return []
    try:
        history = read_history(root)
    except ValueError:
        history = []
    if folder.name in history:
        return history[history.index(folder.name):]
    return [folder.name] if _STEP.fullmatch(folder.name) else []


# ---------------------------------------------------------------------------------- write


def publish(root: Path, tmp: Path, step: int, *, keep_last: int, history: Sequence[str],
            on_stage: Stage = None) -> Path:
    """Move the written folder ``tmp`` to ``root/step_N``, record it first in ``latest`` before ``history``
    (this run's earlier checkpoints, newest first), keep ``keep_last`` of them and delete the rest. Returns
    the folder."""
    stage = on_stage or (lambda name: None)
    final = root / folder_name(step)
    aside = root / f".old-{final.name}-{os.getpid()}"
    stage("set_aside")
    if os.path.lexists(final):  # a re-write of this step: the old folder stays whole until the new one is in
        os.rename(final, aside)
    stage("rename")
    os.rename(tmp, final)
    fsync_path(root)
    names = [final.name] + [n for n in history if n != final.name and (root / n).is_dir()
                            and not (root / n).is_symlink()]
    stage("latest")
    _write_latest(root, names[:keep_last])
    stage("remove_aside")
    if os.path.lexists(aside):
        _remove(aside)
    stage("prune")
    for name in names[keep_last:]:
        _remove(root / name)
    return final


def _fully_written(folder: Path, name: str) -> bool:
    """Whether a stopped writer's temporary folder got past its last file: every file is there and
    trainer_state.json (written last) is whole and names this step."""
    if not is_complete(folder):
        return False
    try:
        state = read_json(folder / "trainer_state.json", root=folder, max_bytes=MAX_STATE_BYTES)
    except (ValueError, OSError):
        return False
    return isinstance(state, dict) and state.get("step") == int(name[len("step_"):])


def _stopped_writers(root: Path) -> dict[tuple[str, str], dict[str, Path]]:
    """What writers that are not running left: {(step folder, writer pid): {"tmp" / "old": folder}}."""
    leftovers: dict[tuple[str, str], dict[str, Path]] = {}
    for entry in sorted(root.iterdir()):
        match = _LEFTOVER.fullmatch(entry.name)
        if match and not _writer_running(int(match.group(3))):
            leftovers.setdefault((match.group(2), match.group(3)), {})[match.group(1)] = entry
    return leftovers


def _stand_in(name: str, found: dict[str, Path]) -> Optional[Path]:
    """What stands in for a missing step folder a stopped writer was replacing or writing: its new folder if
    fully written, else the complete folder it set aside."""
    new, old = found.get("tmp"), found.get("old")
    if new is not None and _fully_written(new, name):
        return new
    return old if old is not None and is_complete(old) else None


def recover(root: Path, log: Log = _stderr) -> None:
    """Finish what stopped writers left in ``root``. A step that is missing although it was set aside or
    ``latest`` names it goes back in place: the writer's new folder if it was fully written, else the folder
    set aside. Then every leftover of a stopped writer goes (half-written folders, set-aside folders,
    ``.latest.tmp-`` files). Only the writing rank calls this, before anything else reads ``root``."""
    if not root.is_dir() or root.is_symlink():
        return
    try:
        named = set(read_history(root))
    except ValueError:
        named = set()
    for entry in root.iterdir():
        latest_tmp = _LATEST_TMP.fullmatch(entry.name)
        if latest_tmp and not _writer_running(int(latest_tmp.group(1))):
            entry.unlink(missing_ok=True)
    removed = []
    for (name, pid), found in _stopped_writers(root).items():
        final = root / name
        if not os.path.lexists(final) and ("old" in found or name in named):
            source = _stand_in(name, found)
            if source is not None:
                os.rename(source, final)
                log(f"checkpoint: {final} was missing when writer {pid} stopped; restored it from {source.name}")
        removed += [entry for entry in found.values() if os.path.lexists(entry)]
    if removed:
        size = sum(_size(entry) for entry in removed)
        for entry in removed:
            _remove(entry)
        log(f"checkpoint: removed {len(removed)} folder(s) left by stopped checkpoint writers in {root} "
            f"({size / 1e6:.1f} MB)")
    fsync_path(root)


# ---------------------------------------------------------------------------------- resume


def _newest_complete(root: Path, preferred: Sequence[str]) -> Optional[Path]:
    """The first complete folder of ``preferred`` (the history, in write order); else the complete ``step_*``
    folder written last (its trainer_state.json's modification time; the higher step on a tie)."""
    for name in preferred:
        if is_complete(root / name):
            return root / name
    others = [p for p in root.iterdir() if _STEP.fullmatch(p.name) and is_complete(p)]
    if not others:
        return None
    return max(others, key=lambda p: (os.lstat(p / "trainer_state.json").st_mtime_ns, p.name))


def resolve_checkpoint(path: Path, log: Log = _stderr) -> Path:
    """A checkpoint folder, or a checkpoints root (the folder its ``latest`` names), or a run's output dir.
    When ``latest`` names a folder that is missing or incomplete, the newest complete one is taken and ``log``
    says so in one line; a folder that is a link to one elsewhere is refused."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if os.path.lexists(candidate / "trainer_state.json"):
            return candidate
        if os.path.lexists(candidate / LATEST):
            return _latest_folder(candidate, log)
    raise FileNotFoundError(f"--resume: no checkpoint at {str(path)!r} (expected trainer_state.json or a "
                            f"'latest' file)")


def _latest_folder(root: Path, log: Log) -> Path:
    names = read_history(root)
    named = root / names[0]
    if named.is_symlink():
        raise ValueError(f"--resume: {root / LATEST} names {names[0]}, a link to {os.path.realpath(named)}; "
                         f"expected a checkpoint folder inside {root}")
    if is_complete(named):
        return named
    if not os.path.lexists(named):  # a writer stopped while replacing it (recover() puts it back in place)
        for (name, pid), found in _stopped_writers(root).items():
            stand_in = _stand_in(name, found) if name == named.name else None
            if stand_in is not None:
                log(f"resume: {root / LATEST} names {named.name}, which writer {pid} was replacing when it "
                    f"stopped; resuming from {stand_in.name}, what it left")
                return stand_in
    fallback = _newest_complete(root, names[1:])
    if fallback is None:
        raise ValueError(f"--resume: {root / LATEST} names {names[0]!r}, which is missing or incomplete, and "
                         f"{root} holds no complete checkpoint")
    log(f"resume: {root / LATEST} names {names[0]}, which is missing or incomplete; resuming from "
        f"{fallback.name}, the newest complete checkpoint")
    return fallback
