"""The set of engine replicas the rollout talks to: executor + clients + router + a supervisor.

:meth:`ReplicaSet.generate` routes one request of a trajectory (DP-aware). When the replica does not answer
(or answers 503: its engine failed, the request never ran) it marks it unhealthy, waits for a healthy one and
resends the same request there (the trajectory's recorded tokens live in the gateway, so nothing is lost; the
partial generation on the dead replica was never recorded). A 4xx is the request's own fault and is raised at
once; a 500/504 (the request ran and failed) is retried on another replica at most ``max_server_errors - 1``
times, so one poisoned request cannot take down every replica in turn. A busy 503 (``Retry-After``) is
retried on the same replica after a pause.

With ``check_response`` (``rollout.response_check.ResponseCheck``) every answer is checked before it is returned:
a malformed or impossible one is counted (``dropped_malformed``), logged once with the engine's URL, and raised as
:class:`~glm5_core.rl.serving.client.MalformedResponse` naming that URL; the runner drops its rollout.

The supervisor thread replaces dead workers and puts them back on the ring. With ``catch_up`` set (the weight
sync's ``catch_up``: ``fleet/weight_sync``), a readmitted replica (restarted, or healthy again after a failure
that may have made it miss pushes) first gets the newest weights, and goes back on the ring only once they are
in; a failed catch-up leaves it off and is retried like a failed replacement. A failed replacement (e.g. the
worker could not start) is logged and retried with exponential backoff; it never stops the supervisor.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from glm5_core.rl.fleet.continuation import continuation, merge
from glm5_core.rl.serving.client import (
    EngineClient,
    EngineRequestError,
    EngineUnavailable,
    GenerationAborted,
    MalformedResponse,
)

logger = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, executor, router, names: list[str], *, poll_seconds: float = 0.5,
                 retry_timeout: float = 300.0, max_server_errors: int = 2, max_restart_backoff: float = 30.0,
                 end_trajectories_timeout: float = 5.0, client_factory: Callable[[str], EngineClient] = EngineClient,
                 check_response: Optional[Callable[[dict, dict], None]] = None):
        if isinstance(max_server_errors, bool) or not isinstance(max_server_errors, int) or max_server_errors < 1:
            raise ValueError(f"max_server_errors: expected an int >= 1, got {max_server_errors!r}")
        self.executor = executor
        self.router = router
        self.names = list(names)
        self.clients: dict[str, EngineClient] = {}
        self._client = client_factory  # url -> client (external engines: remote hosts allowed, api key)
        self.replacements = 0
        self.failed_restarts = 0
        self.failed_requests = 0
        self.continued_generations = 0  # answers aborted by an engine (a weight push) and asked for again
        self.dropped_malformed = 0  # answers refused by check_response (their rollouts are dropped)
        self.last_error = ""
        self._check_response = check_response
        self._poll = poll_seconds
        self._retry_timeout = retry_timeout
        self._max_server_errors = max_server_errors
        self._max_backoff = max_restart_backoff
        self._end_timeout = end_trajectories_timeout
        self._lock = threading.Lock()  # one replacement at a time
        self._stats_lock = threading.Lock()  # counters written by many episode threads
        self._restart_failures: dict[str, int] = {}  # supervisor thread only
        self._next_restart: dict[str, float] = {}  # supervisor thread only: monotonic time of the next try
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._no_end_route: set = set()  # replicas without /end_trajectories (SGLang)
        # (name, client, admit) -> None: the newest weights to a readmitted replica, then admit() puts it back
        self.catch_up: Optional[Callable[[str, EngineClient, Callable[[], None]], None]] = None

    def start(self) -> ReplicaSet:
        for name in self.names:
            self.clients[name] = self._client(self.executor.start(name))
            self.router.add_replica(name)
        self._thread = threading.Thread(target=self._supervise, name="rl-supervisor", daemon=True)
        self._thread.start()
        return self

    # -- supervision ------------------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self._stop.wait(self._poll):
            for name in self.names:
                if self._stop.is_set():
                    return
                if time.monotonic() < self._next_restart.get(name, 0.0):
                    continue
                try:
                    self._check(name)
                except Exception as exc:  # a failed restart must not end supervision: back off, try again
                    self._restart_failed(name, exc)
                else:
                    self._restart_failures.pop(name, None)
                    self._next_restart.pop(name, None)

    def _check(self, name: str) -> None:
        if not self.executor.is_alive(name):
            self.replace(name)
        elif name not in self.router.healthy_replicas():
            if self.clients[name].health():  # a transient failure: back on the ring (after a catch-up)
                self._readmit(name)
            else:
                self.replace(name)

    def _restart_failed(self, name: str, exc: Exception) -> None:
        failures = self._restart_failures.get(name, 0) + 1
        self._restart_failures[name] = failures
        delay = min(self._max_backoff, self._poll * 2 ** min(failures, 30))
        self._next_restart[name] = time.monotonic() + delay
        with self._stats_lock:
            self.failed_restarts += 1
            self.last_error = f"replacing {name}: {type(exc).__name__}: {exc}"
        logger.warning("replica %s: replacement failed (attempt %d, next try in %.1fs): %s: %s",
                       name, failures, delay, type(exc).__name__, exc)

    def replace(self, name: str) -> None:
        """Restart worker ``name`` unless it is alive and healthy; raises what the executor raised."""
        with self._lock:
            if self.executor.is_alive(name) and name in self.clients and self.clients[name].health():
                return
            self.router.mark_unhealthy(name)
            url = self.executor.restart(name)
            self.clients[name] = self._client(url)
            self.replacements += 1
            self._readmit(name)

    def _readmit(self, name: str) -> None:
        """``name`` back on the ring, after the catch-up push when there is one (raises what it raised)."""
        if self.catch_up is None:
            self.router.mark_healthy(name)
        else:
            self.catch_up(name, self.clients[name], lambda: self.router.mark_healthy(name))

    # -- requests ---------------------------------------------------------------------------------------
    def _request_failed(self, name: Optional[str], exc: Exception) -> None:
        with self._stats_lock:
            self.failed_requests += 1
            self.last_error = repr(exc)
        if name is not None:
            self.router.mark_unhealthy(name)

    def generate(self, trajectory_id: str, request: dict) -> dict:
        """One generation of ``trajectory_id``. An answer aborted by the engine (a weight push pauses engines in
        SGLang's ``abort`` mode) is continued: its tokens are kept with the versions that sampled them and the
        rest is asked for again (``continuation``), the parts merged into one answer."""
        parts: list[dict] = []
        current = request
        deadline = time.monotonic() + self._retry_timeout
        while True:
            try:
                response, url = self._generate_once(trajectory_id, current, deadline)
            except GenerationAborted as exc:
                partial = exc.response
                if self._check_response is not None:
                    self._checked(exc.server_url, trajectory_id, current, partial)
                with self._stats_lock:
                    self.continued_generations += 1
                if time.monotonic() > deadline:
                    raise
                if not partial.get("output_ids"):  # aborted before its first token: ask again
                    time.sleep(min(self._poll, 0.05))
                    continue
                parts.append(partial)
                current = continuation(current, partial)
                if current["sampling_params"].get("max_new_tokens") == 0:  # it had sampled all it was asked
                    done = merge(parts)
                    done["meta_info"]["finish_reason"] = {"type": "length", "length": len(done["output_ids"])}
                    return done
                continue
            if self._check_response is not None:
                self._checked(url, trajectory_id, current, response)
            return merge(parts + [response])

    def _generate_once(self, trajectory_id: str, request: dict, deadline: float) -> tuple[dict, str]:
        """One request, retried on failures as the module docstring says; (the answer, the engine's URL)."""
        server_errors = 0
        while True:
            if self._stop.is_set():  # shut down: no more retries (episode threads must not outlive the run)
                raise EngineUnavailable(f"trajectory {trajectory_id}: the replica set was shut down")
            try:
                name = self.router.acquire(trajectory_id)
            except RuntimeError:  # no healthy replica right now: the supervisor is replacing one
                if time.monotonic() > deadline:
                    raise
                time.sleep(self._poll)
                continue
            try:
                client = self.clients[name]
                url = getattr(client, "url", name)
                try:
                    response = client.generate(request)
                except GenerationAborted as exc:  # not the engine's failure: the caller continues it
                    exc.server_url = url
                    raise
                return response, url
            except GenerationAborted:
                raise
            except EngineRequestError as exc:
                if exc.status < 500:  # the request's own fault: the same answer anywhere
                    raise
                if exc.busy:  # alive, at its connection cap: wait, then try again (same replica, same cache)
                    self._request_failed(None, exc)
                    if time.monotonic() + exc.retry_after > deadline:
                        raise
                    time.sleep(exc.retry_after)
                    continue
                if exc.status != 503:  # it ran and failed: maybe this request is what breaks engines
                    server_errors += 1
                # a 504 is a slow replica, not a broken one: keep it (and its trajectories' caches) on the ring
                self._request_failed(None if exc.status == 504 else name, exc)
                if server_errors >= self._max_server_errors or time.monotonic() > deadline:
                    raise
            except EngineUnavailable as exc:
                self._request_failed(name, exc)
                if time.monotonic() > deadline:
                    raise
            finally:
                self.router.release(trajectory_id, name)

    def _checked(self, url: str, trajectory_id: str, request: dict, response: dict) -> None:
        try:
            self._check_response(request, response)
        except MalformedResponse as exc:
            error = MalformedResponse(exc.reason, server=url)
            with self._stats_lock:
                self.dropped_malformed += 1
                self.last_error = str(error)
            logger.warning("engine %s sent a malformed answer for trajectory %s (rollout dropped): %s",
                           url, trajectory_id, exc.reason)
            raise error from None

    def healthy_clients(self) -> dict[str, EngineClient]:
        healthy = set(self.router.healthy_replicas())
        return {name: self.clients[name] for name in self.names if name in healthy and name in self.clients}

    def mark_failed(self, name: str) -> None:
        self.router.mark_unhealthy(name)

    def end_trajectories(self, rids: list[str]) -> None:
        """Finished trajectories: every healthy replica frees their prefix-cache entries. Best effort, with a
        short timeout (``end_trajectories_timeout``): this runs on episode threads, and a replica that does not
        answer has lost its cache anyway, or keeps dead entries until LRU eviction. A server without the route
        (SGLang: 404) is not asked again."""
        if not rids:
            return
        for name, client in self.healthy_clients().items():
            if name in self._no_end_route:
                continue
            try:
                client.end_trajectories(rids, timeout=self._end_timeout)
            except EngineRequestError as exc:
                if exc.status == 404:
                    self._no_end_route.add(name)
            except EngineUnavailable:
                pass

    def info(self) -> dict[str, dict]:
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
        self._pending: list[str] = []
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
