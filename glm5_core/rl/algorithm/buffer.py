"""Trajectory buffer between rollout and trainer.

* the trainer takes a batch only once ``batch_size`` trajectories are ready (whole groups, so advantages can be
  normalised within the group);
* samples older than ``max_staleness`` policy versions are dropped at take time (counted, not trained), with
  their whole group; a trajectory without sampled tokens (its prompt filled ``max_len``) is never stale;
* exactly-once accounting: a trajectory id can be put once and taken once; a duplicate is a bug and raises;
* dynamic sampling (``dynamic``, see ``dynamic_sampling``): a completed group with equal rewards is held back,
  and fills a batch only once the sampling rounds for it are spent; the held-back groups a batch did not
  use are dropped when it is taken.
* staleness-paced admission (``admission=True``, ``rollout.admission: staleness``; AReaL's staleness manager made
  exact): a group is admitted (started) only if it can still be trained within ``max_staleness`` versions of
  the weights it starts under, and the trainer takes batches earliest-deadline-first and waits rather than step
  past an admitted group's deadline, so admitted work is never dropped as stale (see :meth:`try_admit`).

:meth:`state_dict` holds the counters a resumed run continues (drops, the staleness histogram, trajectories
trained), not trajectories: a sync run's buffer is empty between steps; what an async run had buffered is lost.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Optional

from glm5_core.rl.algorithm.dynamic_sampling import DynamicSampler
from glm5_core.rl.rollout.trajectory import Trajectory


def staleness(trajectories: list[Trajectory], policy_version: int) -> list[int]:
    """Policy versions each trajectory's oldest sampled token is behind ``policy_version``. A trajectory that
    sampled nothing (``oldest_version`` -1) has no age and is left out."""
    return [max(0, policy_version - t.oldest_version) for t in trajectories if t.oldest_version >= 0]


class TrajectoryBuffer:
    def __init__(self, *, batch_size: int, group_size: int, max_staleness: Optional[int] = None,
                 dynamic_max_rounds: Optional[int] = None, admission: bool = False):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not isinstance(group_size, int) or group_size < 1 or batch_size % group_size:
            raise ValueError(f"group_size: expected an int >= 1 dividing batch_size={batch_size}, got {group_size!r}")
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness: expected None or an int >= 0, got {max_staleness!r}")
        self.batch_size = batch_size
        self.group_size = group_size
        self.max_staleness = max_staleness
        self._cond = threading.Condition()
        self._pending: dict[str, list[Trajectory]] = collections.OrderedDict()  # group id -> members so far
        self._ready: list[list[Trajectory]] = []  # complete groups, oldest first
        self._seen: set = set()
        self.taken_ids: list[str] = []
        self.dropped_stale = 0
        self.dropped_ids: list[str] = []
        self.dropped_env_failures = 0
        self.staleness_histogram: dict[int, int] = collections.Counter()
        self._closed = False
        self._trained_before = 0  # trajectories trained before a resume
        if admission and (max_staleness is None or dynamic_max_rounds is not None):
            raise ValueError("admission: staleness-paced admission needs max_staleness and no dynamic sampling")
        self.admission = admission
        self._deadlines: dict[str, int] = {}  # admitted, untrained group -> the last version it may be taken at
        self._next_take: Optional[int] = None  # the policy version of the next take (admission's clock)
        self.admission_refusals = 0  # times a group was held back because it could not finish in time
        self.dynamic = (DynamicSampler(max_rounds=dynamic_max_rounds, groups_per_batch=batch_size // group_size)
                        if dynamic_max_rounds is not None else None)

    def _feasible(self, deadlines: list[int], next_take: int) -> bool:
        """Every group can be taken by its deadline, ``batch_size`` trajectories a take from ``next_take`` on:
        for each deadline d, the trajectories due by d fit in the takes at versions next_take..d."""
        due = 0
        for d in sorted(deadlines):
            due += self.group_size
            if due > (d - next_take + 1) * self.batch_size:
                return False
        return True

    def try_admit(self, group_id: str, weights_version: int, trainer_version: int) -> bool:
        """Admission mode: admit group ``group_id`` to start under ``weights_version`` (the newest version every
        engine holds, so its tokens are sampled at that version or later) if, with it, every admitted untrained
        group can still be taken within ``max_staleness`` of its start (``trainer_version``: the version of the
        next take). True: admitted, its deadline recorded. Without admission mode: always True."""
        if not self.admission:
            return True
        with self._cond:
            if self._next_take is None or trainer_version > self._next_take:
                self._next_take = trainer_version
            deadline = weights_version + self.max_staleness
            if not self._feasible([*self._deadlines.values(), deadline], self._next_take):
                self.admission_refusals += 1
                return False
            self._deadlines[group_id] = deadline
            return True

    def put(self, trajectory: Trajectory) -> None:
        with self._cond:
            if trajectory.trajectory_id in self._seen:
                raise RuntimeError(f"trajectory {trajectory.trajectory_id!r} put twice")
            self._seen.add(trajectory.trajectory_id)
            group = self._pending.setdefault(trajectory.group_id, [])
            group.append(trajectory)
            if len(group) == self.group_size:
                del self._pending[trajectory.group_id]
                if self.dynamic is None or self.dynamic.admit(group):
                    self._ready.append(group)
                self._cond.notify_all()

    def num_ready(self) -> int:
        with self._cond:
            return sum(len(g) for g in self._ready)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _is_stale(self, group: list[Trajectory], policy_version: int) -> bool:
        return self.max_staleness is not None and any(  # oldest_version -1: no sampled token, never stale
            t.oldest_version >= 0 and policy_version - t.oldest_version > self.max_staleness for t in group)

    def _drop_stale(self, policy_version: int) -> None:
        if self.dynamic is not None:
            fresh = [g for g in self.dynamic.held if not self._is_stale(g, policy_version)]
            for group in self.dynamic.held:
                if not self._is_stale(group, policy_version):
                    continue
                self._deadlines.pop(group[0].group_id, None)
                self.dropped_stale += len(group)
                self.dropped_ids.extend(t.trajectory_id for t in group)
            self.dynamic.held = fresh
        keep = []
        for group in self._ready:
            if any(t.env_failed for t in group):
                self._deadlines.pop(group[0].group_id, None)
                self.dropped_env_failures += len(group)
                self.dropped_ids.extend(t.trajectory_id for t in group)
                continue
            if self._is_stale(group, policy_version):
                self._deadlines.pop(group[0].group_id, None)
                self.dropped_stale += len(group)
                self.dropped_ids.extend(t.trajectory_id for t in group)
            else:
                keep.append(group)
        self._ready = keep

    def _admitted_batch_ready(self, policy_version: int) -> bool:
        """Admission mode: order the ready groups earliest deadline first; True when ``batch_size`` are ready
        and, once they are taken, every admitted group left (running ones included) can still be taken by its
        deadline. False: the trainer waits for the running groups that are due (a bubble, named in metrics)."""
        if sum(len(g) for g in self._ready) < self.batch_size:
            return False
        self._ready.sort(key=lambda g: self._deadlines.get(g[0].group_id, policy_version + self.max_staleness))
        taken = {g[0].group_id for g in self._ready[:self.batch_size // self.group_size]}
        left = [d for gid, d in self._deadlines.items() if gid not in taken]
        return self._feasible(left, policy_version + 1)

    def _filled_from_held(self, fill_held: bool) -> bool:
        """Dynamic sampling with its rounds spent (``fill_held``: the caller says so; async: counted here):
        held-back groups complete the batch. True if the batch is complete."""
        if self.dynamic is None or not (fill_held or self.dynamic.rounds_spent()):
            return False
        missing = self.batch_size - sum(len(g) for g in self._ready)
        if missing > len(self.dynamic.held) * self.group_size:
            return False
        self._ready.extend(self.dynamic.fill(-(-missing // self.group_size)))
        return True

    def take(self, policy_version: int, timeout: Optional[float] = None, *,
             fill_held: bool = False) -> Optional[list[Trajectory]]:
        """Block until ``batch_size`` fresh trajectories are ready; None on timeout or close. ``fill_held``
        (dynamic sampling, sync mode): the last sampling round for this batch is done, held-back groups may
        fill it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._drop_stale(policy_version)
                if self.admission:
                    if self._admitted_batch_ready(policy_version):
                        break
                elif sum(len(g) for g in self._ready) >= self.batch_size or self._filled_from_held(fill_held):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed or (remaining is not None and remaining <= 0):
                    return None
                self._cond.wait(remaining if remaining is not None else 0.5)
            batch: list[Trajectory] = []
            while len(batch) < self.batch_size:
                batch.extend(self._ready.pop(0))
            for group_id in {t.group_id for t in batch}:
                self._deadlines.pop(group_id, None)
            if self.admission:
                self._next_take = policy_version + 1
            self.taken_ids.extend(t.trajectory_id for t in batch)
            self.staleness_histogram.update(staleness(batch, policy_version))
            if self.dynamic is not None:
                self.dynamic.batch_taken()
                self.dropped_ids.extend(self.dynamic.dropped_ids)
                self.dynamic.dropped_ids = []
            return batch

    def trained_total(self) -> int:
        """Trajectories trained by this run, before a resume included."""
        with self._cond:
            return self._trained_before + len(self.taken_ids)

    def state_dict(self) -> dict:
        with self._cond:
            return {"trained": self._trained_before + len(self.taken_ids), "dropped_stale": self.dropped_stale,
                    "dropped_env_failures": self.dropped_env_failures,
                    "staleness_histogram": {str(k): n for k, n in sorted(self.staleness_histogram.items())}}

    def load_state_dict(self, state: dict) -> None:
        """Continue the counters of :meth:`state_dict`; ValueError naming the key for anything but counts."""
        counts = {key: state.get(key, 0) for key in ("trained", "dropped_stale", "dropped_env_failures")}
        histogram = state.get("staleness_histogram", {})
        if not isinstance(histogram, dict):
            raise ValueError(f"buffer.staleness_histogram: expected an object, got {type(histogram).__name__}")
        for key, value in [*counts.items(), *((f"staleness_histogram.{k}", v) for k, v in histogram.items())]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"buffer.{key}: expected an int >= 0, got {value!r:.60}")
        if not all(k.isdigit() and len(k) <= 12 for k in histogram):
            raise ValueError(f"buffer.staleness_histogram: expected version lags as keys, got {sorted(histogram)[:3]}")
        with self._cond:
            self._trained_before = counts["trained"]
            self.dropped_stale = counts["dropped_stale"]
            self.dropped_env_failures = counts["dropped_env_failures"]
            self.staleness_histogram = collections.Counter({int(k): v for k, v in histogram.items()})

    def leftover_ids(self) -> list[str]:
        with self._cond:
            ids = [t.trajectory_id for g in self._ready for t in g]
            ids += [t.trajectory_id for g in self._pending.values() for t in g]
            ids += [t.trajectory_id for g in (self.dynamic.held if self.dynamic else ()) for t in g]
            return ids


def build_buffer(cfg) -> TrajectoryBuffer:
    """The buffer of RLConfig ``cfg``: ``train.batch_size`` / ``train.max_staleness``, ``rollout.group_size``,
    and ``dynamic_sampling``."""
    ds = cfg.dynamic_sampling
    return TrajectoryBuffer(batch_size=cfg.train.batch_size, group_size=cfg.rollout.group_size,
                            max_staleness=cfg.train.max_staleness,
                            dynamic_max_rounds=ds.max_rounds if ds.enabled else None,
                            admission=cfg.mode == "async" and cfg.rollout.admission == "staleness")
