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
import time
import uuid
from collections.abc import Iterator
from typing import Optional

import torch

from glm5_core.rl.serving.client import EngineClient, EngineRequestError, EngineUnavailable

logger = logging.getLogger(__name__)


class FleetPushError(RuntimeError):
    """Engines failed a push (unreachable or 5xx): they are marked unhealthy and the run goes on."""


class WeightPushError(RuntimeError):
    """An engine refused a push (4xx): the trainer's own fault, the same on every engine; the run ends."""


NOT_FLUSHED = "cache was not flushed"  # sglang 0.5.23 WeightUpdater.flush_cache_after_weight_update


def _refused(client: EngineClient, what: str, exc: EngineRequestError) -> WeightPushError:
    return WeightPushError(f"{client.url} refused {what}: HTTP {exc.status}: {exc}")


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

    def push(self, path: str, version: int) -> None:
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
        self._group = None
        self._group_name = ""
        self._members: dict[str, EngineClient] = {}
        self.failed_pushes = 0
        self.last_error = ""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rl-weight-sync")

    def _on_all(self, fn, members: dict[str, EngineClient]) -> dict[str, Optional[BaseException]]:
        """``fn(client)`` on every member at once; what each raised (None: it succeeded)."""
        futures = {name: self._pool.submit(fn, client) for name, client in members.items()}
        return {name: future.exception() for name, future in futures.items()}

    def _form_group(self, members: dict[str, EngineClient]) -> None:
        from glm5_core.rl.serving.weight_group import WeightUpdateGroup

        self.close()
        self._pool.shutdown(wait=True)  # every member's request must be in flight at once during a broadcast
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(members) + 1,
                                                           thread_name_prefix="rl-weight-sync")
        port = free_port(self.master_address)
        name = f"glm5-weights-{uuid.uuid4().hex[:12]}"
        order = list(members)
        futures = {n: self._pool.submit(members[n].init_weights_update_group, self.master_address, port, i + 1,
                                        len(order) + 1, name, self.backend, self.timeout_s + 30)
                   for i, n in enumerate(order)}
        try:
            group = WeightUpdateGroup(master_address=self.master_address, master_port=port, rank=0,
                                      world_size=len(order) + 1, group_name=name, backend=self.backend,
                                      timeout_s=self.timeout_s)
        finally:
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
        self._group, self._group_name, self._members = group, name, dict(members)

    def push(self, model, version: int) -> None:
        """Send ``model``'s weights as ``version``. Engines that fail are marked unhealthy and counted in
        ``failed_pushes``; the group is formed again at the next push."""
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
        if self._group is None or set(members) != set(self._members):
            self._form_group(members)
        members = self._members
        state = {k: v.detach() for k, v in model.state_dict().items()}
        for _name, exc in self._on_all(_pause, members).items():
            if exc is not None and not _is_fleet_error(exc):
                raise exc
        try:
            parts = list(buckets(state, self.bucket_bytes))
            for i, part in enumerate(parts):
                self._send_bucket(part, version, flush=self.flush_cache and i == len(parts) - 1)
        except BaseException:
            self.close()  # a half-sent group is unusable: form it again next time
            raise
        finally:
            self._on_all(_resume, members)
        self.seconds.append(time.monotonic() - t0)

    def _send_bucket(self, part: list[tuple[str, torch.Tensor]], version: int, *, flush: bool) -> None:
        names = [n for n, _ in part]
        dtypes = [str(t.dtype).replace("torch.", "") for _, t in part]
        shapes = [list(t.shape) for _, t in part]
        on_host = self.backend == "gloo"
        tensors = [(t.cpu() if on_host else t).contiguous() for _, t in part]
        futures = {n: self._pool.submit(c.update_weights_from_distributed, names, dtypes, shapes, self._group_name,
                                        version, flush_cache=flush, timeout=self.timeout_s + 30)
                   for n, c in self._members.items()}
        broadcast_error = None
        try:
            self._group.broadcast(tensors)
        except RuntimeError as exc:  # a peer died or timed out mid-broadcast
            broadcast_error = exc
        errors = {n: f.exception() for n, f in futures.items()}
        failed = {n: e for n, e in errors.items() if e is not None}
        if broadcast_error is not None and not failed:
            raise FleetPushError(f"weight push v{version}: broadcast failed: {broadcast_error}")
        for n, exc in failed.items():
            if not _is_fleet_error(exc):
                raise exc
            self.replicas.mark_failed(n)
        if failed:
            raise FleetPushError(f"weight push v{version}: {', '.join(failed)} failed: {next(iter(failed.values()))}")

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            self._on_all(lambda c: c.destroy_weights_update_group(self._group_name, timeout=10), self._members)
            group.close()
        self._members = {}

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
