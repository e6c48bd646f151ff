"""The set of engine replicas the rollout talks to: executor + clients + router + a supervisor.

:meth:`ReplicaSet.generate` routes one request of a trajectory (DP-aware), and when the replica does not
answer it marks it unhealthy, waits for a healthy one and resends the same request there (the trajectory's
recorded tokens live in the gateway, so nothing is lost; the partial generation on the dead replica was
never recorded). The supervisor thread replaces dead workers and puts them back on the ring.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional

from glm5_core.rl.client import EngineClient, EngineRequestError, EngineUnavailable


class ReplicaSet:
    def __init__(self, executor, router, names: List[str], *, poll_seconds: float = 0.5,
                 retry_timeout: float = 300.0):
        self.executor = executor
        self.router = router
        self.names = list(names)
        self.clients: Dict[str, EngineClient] = {}
        self.replacements = 0
        self.failed_requests = 0
        self.last_error = ""
        self._poll = poll_seconds
        self._retry_timeout = retry_timeout
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "ReplicaSet":
        for name in self.names:
            self.clients[name] = EngineClient(self.executor.start(name))
            self.router.add_replica(name)
        self._thread = threading.Thread(target=self._supervise, name="rl-supervisor", daemon=True)
        self._thread.start()
        return self

    def _supervise(self) -> None:
        while not self._stop.wait(self._poll):
            for name in self.names:
                if self._stop.is_set():
                    return
                if not self.executor.is_alive(name):
                    self.replace(name)
                elif name not in self.router.healthy_replicas():
                    if self.clients[name].health():  # a transient failure: back on the ring
                        self.router.mark_healthy(name)
                    else:
                        self.replace(name)

    def replace(self, name: str) -> None:
        with self._lock:
            if self.executor.is_alive(name) and self.clients[name].health():
                return
            self.router.mark_unhealthy(name)
            url = self.executor.restart(name)
            self.clients[name] = EngineClient(url)
            self.replacements += 1
            self.router.mark_healthy(name)

    def generate(self, trajectory_id: str, request: Dict) -> Dict:
        deadline = time.monotonic() + self._retry_timeout
        while True:
            try:
                name = self.router.acquire(trajectory_id)
            except RuntimeError:  # no healthy replica right now: the supervisor is replacing one
                if time.monotonic() > deadline:
                    raise
                time.sleep(self._poll)
                continue
            try:
                return self.clients[name].generate(request)
            except (EngineUnavailable, EngineRequestError) as exc:
                if isinstance(exc, EngineRequestError) and exc.status < 500:
                    raise
                self.failed_requests += 1
                self.last_error = repr(exc)
                self.router.mark_unhealthy(name)
                if time.monotonic() > deadline:
                    raise
            finally:
                self.router.release(trajectory_id, name)

    def broadcast_weights(self, path: str, version: int) -> None:
        """Tell every replica to load ``path``; an unreachable one will start from the latest weights anyway."""
        for name in self.names:
            try:
                self.clients[name].update_weights_from_disk(path, version)
            except EngineUnavailable:
                self.router.mark_unhealthy(name)

    def end_trajectories(self, rids: List[str]) -> None:
        """Finished trajectories: every replica frees their prefix-cache entries (best effort: a replica that
        does not answer has lost its cache anyway, or keeps dead entries until LRU eviction)."""
        if not rids:
            return
        for name in self.names:
            try:
                self.clients[name].end_trajectories(rids)
            except (EngineUnavailable, EngineRequestError):
                pass

    def info(self) -> Dict[str, Dict]:
        out = {}
        for name in self.names:
            try:
                out[name] = self.clients[name].info()
            except (EngineUnavailable, EngineRequestError):
                out[name] = {}
        return out

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.executor.shutdown()


class TrajectoryCloser:
    """Collects finished trajectory ids and sends them to ``send`` (``ReplicaSet.end_trajectories``) in
    batches of ``batch``, so a short-trajectory task does not pay one HTTP round trip per trajectory.
    Thread-safe; :meth:`flush` sends what is left."""

    def __init__(self, send, *, batch: int = 16):
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch: expected an int >= 1, got {batch!r}")
        self._send = send
        self._batch = batch
        self._pending: List[str] = []
        self._lock = threading.Lock()

    def add(self, trajectory_id: str) -> None:
        with self._lock:
            self._pending.append(trajectory_id)
            if len(self._pending) < self._batch:
                return
            ready, self._pending = self._pending, []
        self._send(ready)

    def flush(self) -> None:
        with self._lock:
            ready, self._pending = self._pending, []
        self._send(ready)
