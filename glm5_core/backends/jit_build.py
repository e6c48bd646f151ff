"""Where JIT-built extensions live, and one builder at a time per build folder, with a lock that cannot
outlive its holder.

Folders: ``<root>/<name>_<key>``, the root from ``GLM5_EXT_DIR`` (default ``$XDG_CACHE_HOME/glm5_core/ext``,
else ``~/.cache/glm5_core/ext``), the key a digest of everything that changes the binary.

``torch.utils.cpp_extension.load`` serialises builds with a ``FileBaton``: the first process creates
``<build_dir>/lock`` and deletes it when done; the others poll until the file is gone. A builder that is
killed (Ctrl-C twice, kill -9, an OOM kill, a timeout) never deletes it, and from then on every process
that loads the extension polls forever at 0% CPU.

:func:`exclusive_build` takes an ``fcntl.flock`` on a separate file in the build folder first. The kernel
drops that lock when its holder dies, however it dies, so waiting on it always ends. A process holding it is
the only glm5_core builder of that folder, so a baton ``lock`` found then was left by a dead one, and is
removed before torch looks at it. (A glm5_core older than this module builds without the flock; two such
versions building one folder at once is the case this does not cover.)
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator

TORCH_BATON = "lock"  # the FileBaton name torch.utils.cpp_extension uses inside build_directory
BUILD_LOCK = "glm5-build.flock"


def cache_root() -> Path:
    if os.environ.get("GLM5_EXT_DIR"):
        return Path(os.environ["GLM5_EXT_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "glm5_core" / "ext"


def build_key(files: Iterable[Path], parts: Iterable[str]) -> str:
    """16 hex digits of a digest of ``parts`` (versions, flags), then each file's name and bytes."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's flock for the block (waiting for a live builder), with no stale baton left."""
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's baton alone, as before
        yield
        return
    fd = os.open(build_dir / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        with contextlib.suppress(FileNotFoundError):
            (build_dir / TORCH_BATON).unlink()  # no live builder owns it: we hold the flock
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the flock
