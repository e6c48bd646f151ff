"""Pushing the trainer's weights to the engines, as SGLang-based RL frameworks (slime) do; ``rollout.weight_sync``.

Every push, on each engine: ``/pause_generation`` in SGLang's default ``abort`` mode (what slime sends), the swap,
the prefix-cache flush (``rollout.flush_cache_on_sync``), ``/continue_generation``. ``abort`` is the one pause
after which SGLang can flush (sglang 0.5.23 ``Scheduler.flush_cache`` refuses while a request runs, and the
update then answers 400 "Weights were updated, but the cache was not flushed ..."; 0.5.15.post1 asserts and the
server dies; ``retract`` leaves the requests queued, which 0.5.15 also refuses). The aborted requests come back
with the tokens they had sampled, each stamped with its version; the replica set asks for the rest
(``fleet/continuation``), so a generation that spans a push carries both versions. Should an engine still
answer that the weights were updated but the cache not flushed, ``/flush_cache`` is retried (as slime does).

* ``disk``: the trainer writes the weights and each engine loads them (``/update_weights_from_disk``). Engines
  glm5 rl spawned read the trainer's ``v*.safetensors`` file; external ones an HF-format directory
  (``save_pretrained``, what SGLang loads), rewritten in place at ``<output_dir>/weights/hf``.
* ``distributed``: the trainer (rank 0) and the engines form a group once (``/init_weights_update_group``), then
  every push sends the tensors in buckets of about ``rollout.sync_bucket_mb``: per bucket, each engine is told
  the names, dtypes and shapes (``/update_weights_from_distributed``) while the trainer broadcasts them. The
  group is formed again when the set of healthy engines changes or a push failed.

  Against sglang 0.5.23 every distributed push runs inside a weight-update session: ``/begin_weight_update``
  before the first bucket, ``/end_weight_update`` after the last (0.5.23's ``WeightUpdater`` answers
  ``/update_weights_from_distributed`` outside one with 400 "update_weights_from_distributed must run between
  begin_weight_update() and end_weight_update()"). A server that answers ``/begin_weight_update`` with 404 (sglang
  0.5.15.post1, which has no such route, and ``glm5 serve``) is updated without one; that answer is remembered per
  engine URL. The group itself is joined on both ends by ``serving/weight_group.init_custom_process_group``,
  SGLang's own construction.

A readmitted engine (restarted, or back from a failure that made it miss pushes) gets a catch-up push of the
newest weights before the replica set routes work to it (``catch_up``): ``disk`` loads the last pushed path;
``distributed`` broadcasts the trainer's saved weights of that version (the ``v*.safetensors`` file the driver
writes at every push, never the live model, which trains meanwhile) over a group of the trainer and that engine
alone. A push and a catch-up never run at once.

An engine that fails a push (unreachable, 5xx) is marked unhealthy, as a failed request would; another 4xx (the
trainer's own fault: bad weights, version moving back) is raised as :class:`WeightPushError`, one line naming the
engine and its answer, which ``glm5 rl`` prints before it exits.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Callable, Optional

import torch

from glm5_core.rl.serving.client import EngineClient, EngineRequestError, EngineUnavailable

logger = logging.getLogger(__name__)


class FleetPushError(RuntimeError):
    """Engines failed a push (unreachable or 5xx): they are marked unhealthy and the run goes on."""


class WeightPushError(RuntimeError):
    """An engine refused a push (4xx): the trainer's own fault, the same on every engine; the run ends."""


NOT_FLUSHED = "cache was not flushed"  # sglang 0.5.23 WeightUpdater.flush_cache_after_weight_update


def _refused(client: EngineClient, what: str, exc: EngineRequestError) -> WeightPushError:
    return WeightPushError(f"{client.url} refused {what}: {exc}")  # str(exc) starts "HTTP <status>: "


def _flush_until_idle(client: EngineClient, attempts: int = 60, pause_s: float = 1.0) -> None:
    """``/flush_cache`` until it succeeds (400 while requests still run), as slime's ``SGLangEngine.flush_cache``."""
    for attempt in range(attempts):
        try:
            client.flush_cache()
            return
        except EngineRequestError as exc:
            if exc.status >= 500 or attempt == attempts - 1:
                raise
            time.sleep(pause_s)


def _is_fleet_error(exc: BaseException) -> bool:
    return isinstance(exc, EngineUnavailable) or (isinstance(exc, EngineRequestError) and exc.status >= 500)


def _pause(client: EngineClient) -> None:
    try:
        client.pause_generation("abort")
    except EngineRequestError as exc:
        if exc.status != 404:  # a server without the route updates between its own steps: nothing to pause
            raise


def _resume(client: EngineClient) -> None:
    try:
        client.continue_generation()
    except (EngineRequestError, EngineUnavailable):
        pass  # it went away meanwhile: the supervisor deals with it


def write_hf_directory(model, path: str) -> str:
    """``save_pretrained`` into a fresh folder, then swap it in place of ``path`` (renames only)."""
    from glm5_core.model import save_pretrained

    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    old = f"{path}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp, transformers_form=False)  # glm5 engines must read back the trainer's exact weights
    if os.path.isdir(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


class DiskWeightSync:
    """``push(path, version)``: every healthy engine loads ``path``."""

    def __init__(self, replicas, *, flush_cache: bool = True):
        self.replicas = replicas
        self.flush_cache = flush_cache
        self.seconds: list[float] = []
        self.catch_ups = 0  # readmitted engines that got the newest weights before taking work
        self._last: Optional[tuple[str, int]] = None  # (path, version) of the newest push
        self._lock = threading.Lock()  # a push and a catch-up never run at once

    def push(self, path: str, version: int) -> None:
        with self._lock:
            self._last = (path, version)
            self._push(path, version)

    def catch_up(self, name: str, client: EngineClient, admit: Callable[[], None]) -> None:
        """The newest weights to readmitted engine ``name``, then ``admit()`` (its return to the ring), both
        before any later push; raises what the engine answered (it stays off the ring, the supervisor retries)."""
        with self._lock:
            if self._last is not None:
                path, version = self._last
                self._update(client, path, version)
                self.catch_ups += 1
            admit()

    def _push(self, path: str, version: int) -> None:
        t0 = time.monotonic()
        for name, client in self.replicas.healthy_clients().items():
            try:
                _pause(client)
                try:
                    self._update(client, path, version)
                finally:
                    _resume(client)
            except (EngineRequestError, EngineUnavailable) as exc:
                if not _is_fleet_error(exc):
                    raise _refused(client, f"weight push v{version} ({path})", exc) from None
                self.replicas.mark_failed(name)
        self.seconds.append(time.monotonic() - t0)

    def _update(self, client: EngineClient, path: str, version: int) -> None:
        try:
            client.update_weights_from_disk(path, version, flush_cache=self.flush_cache)
        except EngineRequestError as exc:
            if exc.status != 400 or NOT_FLUSHED not in str(exc):
                raise
            logger.warning("%s loaded weights v%s but did not flush its cache (requests still running): "
                           "flushing again", client.url, version)
            _flush_until_idle(client)

    def close(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``state`` in order, cut into lists of about ``bucket_bytes`` (a tensor larger than that is one bucket)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items():
        if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class _Group:
    """A formed weight-update group: the trainer's end, its name and its members (engine name -> client)."""

    def __init__(self, group, name: str, members: dict[str, EngineClient]):
        self.group, self.name, self.members = group, name, members


class DistributedWeightSync:
    """``push(model, version)``: broadcast ``model``'s weights to every healthy engine over a weight-update
    group in which the trainer is rank 0."""

    def __init__(self, replicas, *, master_address: str = "127.0.0.1", backend: str = "gloo",
                 bucket_bytes: int = 64 << 20, flush_cache: bool = True, timeout_s: float = 300.0):
        self.replicas = replicas
        self.master_address = master_address
        self.backend = backend
        self.bucket_bytes = int(bucket_bytes)
        self.flush_cache = flush_cache
        self.timeout_s = timeout_s
        self.seconds: list[float] = []
        self._main: Optional[_Group] = None
        self.failed_pushes = 0
        self.catch_ups = 0
        self.last_error = ""
        self._no_session: set = set()  # engine URLs that answered /begin_weight_update with 404 (sglang 0.5.15)
        self._last: Optional[tuple[Optional[str], int]] = None  # (saved weights file, version) of the newest push
        self._lock = threading.Lock()  # a push and a catch-up never run at once
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rl-weight-sync")

    def _on_all(self, fn, members: dict[str, EngineClient]) -> dict[str, Optional[BaseException]]:
        """``fn(client)`` on every member at once; what each raised (None: it succeeded)."""
        futures = {name: self._pool.submit(fn, client) for name, client in members.items()}
        return {name: future.exception() for name, future in futures.items()}

    def _form_group(self, members: dict[str, EngineClient]) -> _Group:
        """A new group of the trainer (rank 0) and ``members`` (ranks 1..), each joining through its
        ``/init_weights_update_group`` while the trainer joins here, all at once."""
        from glm5_core.rl.serving.weight_group import WeightUpdateGroup

        if self._pool._max_workers < len(members) + 1:  # every member's request in flight at once
            self._pool.shutdown(wait=True)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(members) + 1,
                                                               thread_name_prefix="rl-weight-sync")
        port = free_port(self.master_address)
        name = f"glm5-weights-{uuid.uuid4().hex[:12]}"
        order = list(members)
        futures = {n: self._pool.submit(members[n].init_weights_update_group, self.master_address, port, i + 1,
                                        len(order) + 1, name, self.backend, self.timeout_s + 30)
                   for i, n in enumerate(order)}
        group = None
        try:
            group = WeightUpdateGroup(master_address=self.master_address, master_port=port, rank=0,
                                      world_size=len(order) + 1, group_name=name, backend=self.backend,
                                      timeout_s=self.timeout_s)
        except RuntimeError as exc:  # a member never joined: the rendezvous timed out
            errors = {n: f.exception() for n, f in futures.items()}
            failed = [n for n, e in errors.items() if e is not None] or order
            for n in failed:
                self.replicas.mark_failed(n)
            raise FleetPushError(f"weight-update group: {', '.join(failed)} did not join: {exc}") from None
        errors = {n: f.exception() for n, f in futures.items()}
        failed = [n for n, e in errors.items() if e is not None]
        if failed:
            group.close()
            for n in failed:
                if _is_fleet_error(errors[n]):
                    self.replicas.mark_failed(n)
            if not all(_is_fleet_error(errors[n]) for n in failed):
                raise next(errors[n] for n in failed if not _is_fleet_error(errors[n]))
            raise FleetPushError(f"weight-update group: {', '.join(failed)} could not join: {errors[failed[0]]}")
        return _Group(group, name, dict(members))

    # -- sglang 0.5.23's weight-update session --------------------------------------------------------------
    def _begin(self, client: EngineClient) -> None:
        if client.url in self._no_session:
            return
        try:
            client.begin_weight_update(timeout=self.timeout_s)
        except EngineRequestError as exc:
            if exc.status == 404:  # sglang 0.5.15.post1 / glm5 serve: no sessions, updates go straight in
                self._no_session.add(client.url)
                return
            if exc.status == 400 and "already open" in str(exc):  # a push that failed left it open: reopen
                client.end_weight_update(timeout=self.timeout_s)
                client.begin_weight_update(timeout=self.timeout_s)
                return
            raise

    def _end(self, client: EngineClient) -> None:
        if client.url in self._no_session:
            return
        try:
            client.end_weight_update(timeout=self.timeout_s)
        except EngineRequestError as exc:
            if exc.status != 400:  # 400: no session open (the engine restarted meanwhile): nothing to close
                raise

    def push(self, model, version: int, *, saved: Optional[str] = None) -> None:
        """Send ``model``'s weights as ``version`` (``saved``: the same weights in a safetensors file, what a
        catch-up sends later). Engines that fail are marked unhealthy and counted in ``failed_pushes``; the
        group is formed again at the next push."""
        with self._lock:
            self._last = (saved, version)
            try:
                self._push(model, version)
            except FleetPushError as exc:
                self.failed_pushes += 1
                self.last_error = str(exc)

    def _push(self, model, version: int) -> None:
        t0 = time.monotonic()
        members = self.replicas.healthy_clients()
        if not members:
            return
        if self._main is None or set(members) != set(self._main.members):
            self._close_main()
            self._main = self._form_group(members)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        try:
            self._send(self._main, state, version, pause=True)
        except BaseException:
            self._close_main()  # a half-sent group is unusable: form it again next time
            raise
        self.seconds.append(time.monotonic() - t0)

    def _send(self, group: _Group, state: dict[str, torch.Tensor], version: int, *, pause: bool) -> None:
        """Pause (``pause``), open the session, every bucket, close the session, resume."""
        members = group.members
        if pause:
            for exc in self._on_all(_pause, members).values():
                if exc is not None and not _is_fleet_error(exc):
                    raise exc
        try:
            self._each(self._begin, members, version, "/begin_weight_update")
            parts = list(buckets(state, self.bucket_bytes))
            for i, part in enumerate(parts):
                self._send_bucket(group, part, version, flush=self.flush_cache and i == len(parts) - 1)
            self._each(self._end, members, version, "/end_weight_update")
        finally:
            if pause:
                self._on_all(_resume, members)

    def _each(self, fn, members: dict[str, EngineClient], version: int, what: str) -> None:
        failed = {n: e for n, e in self._on_all(fn, members).items() if e is not None}
        for n, exc in failed.items():
            if not _is_fleet_error(exc):
                raise _refused(members[n], f"{what} (weight push v{version})", exc)
            self.replicas.mark_failed(n)
        if failed:
            raise FleetPushError(f"weight push v{version}: {', '.join(failed)} failed {what}: "
                                 f"{next(iter(failed.values()))}")

    def _send_bucket(self, group: _Group, part: list[tuple[str, torch.Tensor]], version: int, *,
                     flush: bool) -> None:
        names = [n for n, _ in part]
        dtypes = [str(t.dtype).replace("torch.", "") for _, t in part]
        shapes = [list(t.shape) for _, t in part]
        on_host = self.backend == "gloo"
        tensors = [(t.cpu() if on_host else t).contiguous() for _, t in part]
        futures = {n: self._pool.submit(c.update_weights_from_distributed, names, dtypes, shapes, group.name,
                                        version, flush_cache=flush, timeout=self.timeout_s + 30)
                   for n, c in group.members.items()}
        broadcast_error = None
        try:
            group.group.broadcast(tensors)
        except RuntimeError as exc:  # a peer died or timed out mid-broadcast
            broadcast_error = exc
        errors = {n: f.exception() for n, f in futures.items()}
        failed = {n: e for n, e in errors.items() if e is not None}
        if broadcast_error is not None and not failed:
            raise FleetPushError(f"weight push v{version}: broadcast failed: {broadcast_error}")
        for n, exc in failed.items():
            if not _is_fleet_error(exc):
                raise _refused(group.members[n], f"weight push v{version}", exc) if isinstance(
                    exc, EngineRequestError) else exc
            self.replicas.mark_failed(n)
        if failed:
            raise FleetPushError(f"weight push v{version}: {', '.join(failed)} failed: {next(iter(failed.values()))}")

    def catch_up(self, name: str, client: EngineClient, admit: Callable[[], None]) -> None:
        """The newest pushed weights (read back from their saved file) to readmitted engine ``name`` over a
        group of the trainer and that engine alone, then ``admit()``, both before any later push. Raises when it
        fails (the engine stays off the ring; the supervisor tries again)."""
        from safetensors.torch import load_file

        with self._lock:
            if self._last is not None and self._last[0] is not None:
                saved, version = self._last
                state = load_file(saved)
                group = self._form_group({name: client})
                try:
                    self._send(group, state, version, pause=False)
                finally:
                    self._close(group)
                self.catch_ups += 1
            admit()

    def _close(self, group: _Group) -> None:
        self._on_all(lambda c: c.destroy_weights_update_group(group.name, timeout=10), group.members)
        group.group.close()

    def _close_main(self) -> None:
        main, self._main = self._main, None
        if main is not None:
            self._close(main)

    def close(self) -> None:
        self._close_main()

    def shutdown(self) -> None:
        self.close()
        self._pool.shutdown(wait=False)


def build_weight_sync(rollout, replicas):
    """The weight sync ``rollout.weight_sync`` names, pushing to ``replicas`` (a ReplicaSet)."""
    if rollout.weight_sync == "distributed":
        return DistributedWeightSync(replicas, master_address=rollout.sync_master_address,
                                     backend=rollout.sync_backend, bucket_bytes=int(rollout.sync_bucket_mb * (1 << 20)),
                                     flush_cache=rollout.flush_cache_on_sync)
    return DiskWeightSync(replicas, flush_cache=rollout.flush_cache_on_sync)
