"""Where JIT-built extensions live, and one builder at a time per build folder, with a lock that cannot
outlive its holder.

Folders: ``<root>/<name>_<key>``, the root from ``GLM5_EXT_DIR`` (default ``$XDG_CACHE_HOME/glm5_core/ext``,
else ``~/.cache/glm5_core/ext``), the key a digest of everything that changes the binary (the sources' bytes,
flags, versions). :func:`load_library` loads the shared object published there, ``<name>_<key>.so``, without
running torch's builder at all; only when it is missing does it build, in a subfolder of its own per source
tree and torch install (``tree-<digest of the absolute paths torch writes into build.ninja>``), then publish
the library by an atomic rename. torch's build files hold those absolute paths, so one build folder shared by
two clones or venvs made each rebuild after the other (ninja sees changed commands); now N clones and venvs
with the same sources compile once between them, and a tree's own build folder is never touched by another.

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
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

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


def tree_key(sources: Sequence[Path], include_paths: Sequence[str]) -> str:
    """16 hex digits of a digest of the absolute paths torch writes into a build's ``build.ninja``: the
    sources and include folders, torch's headers and libraries, the Python headers and interpreter."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    parts = [str(Path(p).resolve()) for p in sources] + [str(Path(p).resolve()) for p in include_paths]
    parts += list(cpp_extension.include_paths()) + [cpp_extension.TORCH_LIB_PATH,
                                                     sysconfig.get_paths()["include"], sys.executable]
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def load_library(build_dir: Path, sources: Sequence[Path], *, cflags: Sequence[str], ldflags: Sequence[str],
                 include_paths: Sequence[str], what: str, minutes: int, verbose: bool = False) -> Path:
    """Load ``<build_dir>/<build_dir.name>.so`` into torch, compiling it first when it is not there yet.

    ``build_dir`` is keyed by content (:func:`build_key`); the compile runs in ``build_dir/tree-<tree_key>``
    under the folder's flock and announces itself on stderr in one line (``what``, ``minutes`` the typical
    time). Returns the loaded library's path; raises what torch's builder raises."""
    import torch
    from torch.utils import cpp_extension

    library = build_dir / f"{build_dir.name}{cpp_extension.LIB_EXT}"
    if not library.exists():
        with exclusive_build(build_dir):
            if not library.exists():  # nobody published it while this process waited on the flock
                _build_and_publish(build_dir, library, sources, cflags=cflags, ldflags=ldflags,
                                   include_paths=include_paths, what=what, minutes=minutes, verbose=verbose)
                return library
    torch.ops.load_library(str(library))
    return library


def _build_and_publish(build_dir: Path, library: Path, sources: Sequence[Path], *, cflags: Sequence[str],
                       ldflags: Sequence[str], include_paths: Sequence[str], what: str, minutes: int,
                       verbose: bool) -> None:
    from torch.utils import cpp_extension

    tree = build_dir / f"tree-{tree_key(sources, include_paths)}"
    tree.mkdir(exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (tree / TORCH_BATON).unlink()  # we hold the folder's flock: no live glm5_core builder owns it
    print(f"glm5: compiling {what} (first use of these sources with this torch, ~{minutes} min; "
          f"GLM5_SKIP_EXT=1 skips it) in {tree} ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    built = cpp_extension.load(name=build_dir.name, sources=[str(p) for p in sources], extra_cflags=list(cflags),
                               extra_ldflags=list(ldflags), extra_include_paths=list(include_paths),
                               build_directory=str(tree), is_python_module=False, verbose=verbose)
    print(f"glm5: {what} compiled in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    staged = build_dir / f".{library.name}.{os.getpid()}.tmp"
    staged.write_bytes(Path(built).read_bytes())
    os.replace(staged, library)  # atomic: a reader sees no library or a whole one
