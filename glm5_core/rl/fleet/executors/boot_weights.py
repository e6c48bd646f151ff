"""Per-replica boot files: the weights a (re)started worker loads, pinned before it is spawned.

The driver's spec names its latest weights file (``v000012.safetensors``), which the trainer prunes once newer
ones exist (``save_weights(keep=3)``). A worker takes seconds to minutes to boot, so that file may be gone by
the time it loads it. Before spawning, the executor therefore hard-links the spec's file to
``boot-{replica}.safetensors`` in the same directory (``os.link`` to a temporary name, then ``os.replace``, so
the boot file is always complete) and hands the worker that path. The link keeps the data alive whatever the
trainer prunes; the trainer only prunes ``v*.safetensors``. Where hard links are not supported the file is
copied instead.

If the spec's file vanished before it could be pinned (the spec was computed just before a prune), the spec is
asked for again; if the file is still missing, the newest boot file already pinned is used, with *its* weight
version (the replica starts a few versions behind and the next weight push catches it up; every token carries
its version, so staleness is accounted for).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import threading
from typing import Callable

from glm5_core.rl.serving.worker import WorkerSpec

BOOT_PREFIX = "boot-"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_NO_HARD_LINKS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES)


def boot_path(directory: str, name: str) -> str:
    if not _SAFE_NAME.fullmatch(name):
        raise ValueError(f"name: expected a replica name of letters, digits, '_', '.', '-', got {name!r}")
    return os.path.join(directory, f"{BOOT_PREFIX}{name}.safetensors")


def link_or_copy(source: str, target: str) -> None:
    """Atomically make ``target`` the same file as ``source`` (a hard link; a copy where links fail).
    Raises ``FileNotFoundError`` when ``source`` does not exist."""
    tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.link(source, tmp)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:  # ENOENT (FileNotFoundError) included
            raise
        shutil.copyfile(source, tmp)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


class BootWeights:
    """Pins each replica's boot weights; thread-safe. :meth:`remove_all` deletes the boot files."""

    def __init__(self, *, spec_attempts: int = 3):
        if not isinstance(spec_attempts, int) or spec_attempts < 1:
            raise ValueError(f"spec_attempts: expected an int >= 1, got {spec_attempts!r}")
        self._spec_attempts = spec_attempts
        self._lock = threading.Lock()
        self._pinned: dict[str, tuple[str, int]] = {}  # replica -> (boot file, weight version)

    def pin(self, name: str, spec_fn: Callable[[str], WorkerSpec]) -> WorkerSpec:
        """``spec_fn(name)`` with ``weights_path`` replaced by this replica's freshly pinned boot file."""
        with self._lock:
            for _ in range(self._spec_attempts):
                spec = spec_fn(name)
                target = boot_path(os.path.dirname(os.path.abspath(spec.weights_path)), name)
                try:
                    link_or_copy(spec.weights_path, target)
                except FileNotFoundError:
                    continue
                self._pinned[name] = (target, spec.weight_version)
                return dataclasses.replace(spec, weights_path=target)
            if not self._pinned:
                raise FileNotFoundError(f"weights_path: {spec.weights_path!r} was removed before replica {name!r} "
                                        "could pin it, and no earlier boot file exists")
            source, version = max(self._pinned.values(), key=lambda pinned: pinned[1])
            target = boot_path(os.path.dirname(source), name)
            link_or_copy(source, target)
            self._pinned[name] = (target, version)
            return dataclasses.replace(spec, weights_path=target, weight_version=version)

    def pinned(self) -> dict[str, tuple[str, int]]:
        with self._lock:
            return dict(self._pinned)

    def remove_all(self) -> None:
        with self._lock:
            for path, _ in self._pinned.values():
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            self._pinned.clear()
