"""Engine workers as local processes (``multiprocessing`` spawn): the default executor.

Each (re)start pins the spec's weights to a per-replica boot file first (:mod:`.boot_weights`), so the trainer
pruning old weight files cannot pull them from under a booting worker. A worker that dies before reporting
its port, reports an error, or stays silent past ``start_timeout`` is killed, reaped and reported as a failed
start (``RuntimeError``). Workers get the executor's pid and exit on their own if it dies (see
:func:`glm5_core.rl.serving.worker.exit_with_parent`).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Callable

from glm5_core.rl.fleet.executors.boot_weights import BootWeights
from glm5_core.rl.fleet.executors.worker_placement import placed
from glm5_core.rl.serving.worker import WorkerSpec, process_main


class LocalProcessExecutor:
    """Starts, checks and replaces engine worker processes. ``spec_fn(name)`` gives the spec for a (re)start,
    so a replacement starts from the latest pushed weights."""

    def __init__(self, spec_fn: Callable[[str], WorkerSpec], *, start_timeout: float = 300.0):
        self._spec_fn = spec_fn
        self._start_timeout = start_timeout
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: dict[str, multiprocessing.Process] = {}
        self.boot_weights = BootWeights()

    def start(self, name: str) -> str:
        """Start worker ``name``; returns its URL once it serves. Raises ``RuntimeError`` if it does not."""
        spec = placed(self.boot_weights.pin(name, self._spec_fn))
        parent, child = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=process_main, args=(spec, child, os.getpid()), name=f"rl-engine-{name}",
                                 daemon=True)
        proc.start()
        child.close()
        try:
            kind, value = self._await_report(name, proc, parent)
        finally:
            parent.close()
        if kind != "port":
            self._stop(proc)
            raise RuntimeError(f"engine worker {name} failed to start: {value}")
        self._procs[name] = proc
        return f"http://127.0.0.1:{value}"

    def _await_report(self, name: str, proc, conn) -> tuple[str, object]:
        """The worker's ``(kind, value)`` report; a worker that exits or hangs first is stopped here."""
        if not conn.poll(self._start_timeout):  # poll() is also True on EOF: the worker exited
            self._stop(proc, grace=0.0)
            raise RuntimeError(f"engine worker {name}: no answer within {self._start_timeout}s")
        try:
            return conn.recv()
        except (EOFError, OSError):
            self._stop(proc)
            raise RuntimeError(f"engine worker {name} exited (exit code {proc.exitcode}) before reporting "
                               "its port") from None

    @staticmethod
    def _stop(proc, grace: float = 5.0) -> None:
        """Reap ``proc``: wait ``grace`` seconds for it to exit, then kill it."""
        proc.join(timeout=grace)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)

    def is_alive(self, name: str) -> bool:
        proc = self._procs.get(name)
        return proc is not None and proc.is_alive()

    def pid(self, name: str) -> int:
        return self._procs[name].pid

    def kill(self, name: str) -> None:
        """Hard-kill worker ``name`` (failure injection)."""
        os.kill(self._procs[name].pid, signal.SIGKILL)
        self._procs[name].join(timeout=10)

    def restart(self, name: str) -> str:
        old = self._procs.pop(name, None)
        if old is not None and old.is_alive():
            old.kill()
            old.join(timeout=10)
        return self.start(name)

    def shutdown(self) -> None:
        for proc in self._procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._procs.clear()
        self.boot_weights.remove_all()
