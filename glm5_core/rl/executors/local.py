"""Engine workers as local processes (``multiprocessing`` spawn): the default executor."""
from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Callable, Dict

from glm5_core.rl.worker import WorkerSpec, process_main


class LocalProcessExecutor:
    """Starts, checks and replaces engine worker processes. ``spec_fn(name)`` gives the spec for a (re)start,
    so a replacement starts from the latest pushed weights."""

    def __init__(self, spec_fn: Callable[[str], WorkerSpec], *, start_timeout: float = 300.0):
        self._spec_fn = spec_fn
        self._start_timeout = start_timeout
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: Dict[str, multiprocessing.Process] = {}

    def start(self, name: str) -> str:
        """Start worker ``name``; returns its URL once it serves."""
        parent, child = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=process_main, args=(self._spec_fn(name), child), name=f"rl-engine-{name}",
                                 daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self._start_timeout):
            proc.kill()
            raise RuntimeError(f"engine worker {name}: no answer within {self._start_timeout}s")
        kind, value = parent.recv()
        parent.close()
        if kind != "port":
            proc.join(timeout=5)
            raise RuntimeError(f"engine worker {name} failed to start: {value}")
        self._procs[name] = proc
        return f"http://127.0.0.1:{value}"

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
