"""Config values that name paths, checked when the config is (``check=`` of a schema field), before a run starts.

Inputs must be regular files or folders (``/dev/zero``, a FIFO or a socket would be read forever or hang);
an output folder must exist or be creatable (not under a file).
"""
from __future__ import annotations

import os
import stat

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _path_text(path: str, key: str, expected: str) -> None:
    """A non-empty string without NUL (the OS cannot name such a file: os.stat raises a bare ValueError)."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{key}: expected {expected}, got {path!r}")
    if "\0" in path:
        raise ValueError(f"{key}: expected {expected}, got {path!r:.80} (a path cannot hold a NUL character)")


def _stat(path: str, key: str, expected: str) -> os.stat_result:
    _path_text(path, key, expected)
    try:
        return os.stat(path)  # follows links: a link to /dev/zero is a device
    except FileNotFoundError:
        raise ValueError(f"{key}: expected {expected}, got {path!r} (no such file or folder)") from None
    except OSError as exc:
        raise ValueError(f"{key}: expected {expected}, got {path!r} ({exc.strerror})") from None


def input_path(path: str, key: str) -> None:
    """An existing regular file or folder."""
    mode = _stat(path, key, "an existing regular file or folder").st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ValueError(f"{key}: expected a regular file or folder, got {path!r} ({_kind(mode)})")


def input_file(path: str, key: str) -> None:
    """An existing regular file."""
    mode = _stat(path, key, "an existing regular file").st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{key}: expected a regular file, got {path!r} "
                         f"({'a folder' if stat.S_ISDIR(mode) else _kind(mode)})")


def input_dir(path: str, key: str) -> None:
    """An existing folder."""
    mode = _stat(path, key, "an existing folder").st_mode
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{key}: expected a folder, got {path!r} ({_kind(mode)})")


def output_dir(path: str, key: str) -> None:
    """A folder that exists, or whose nearest existing ancestor is a folder (so that it can be created)."""
    _path_text(path, key, "a folder to write into")
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent
    if not os.path.isdir(current):
        where = "is" if current == os.path.abspath(path) else f"is under {current!r}, which is"
        raise ValueError(f"{key}: expected a folder that exists or can be created, got {path!r} "
                         f"(it {where} not a folder)")
