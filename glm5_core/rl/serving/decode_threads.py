"""Concurrent decode: a decode step's active slots split into contiguous groups, each decoded by its own thread.

Legend: A active slots, G groups (``<= threads``).

A decode step on CPU is many small ops (one token per slot through every layer). Splitting each of them
across cores (intra-op threads) costs a fork / join per op, which on a busy machine waits for a descheduled
thread and costs more than the op. Instead each group runs the whole forward on one thread with one
intra-op thread (torch's intra-op setting is per thread under OpenMP), the groups concurrently (torch ops
release the GIL): every core busy with a long stretch of work. A group is a window of the batched cache
(``kv_slots.row_window``), so the groups write disjoint rows. One group (batch 1, or ``threads=1``) runs
on the calling thread.

The engine's default is one decoding thread: on this project's shared 2-core machine (load 15-18) one
thread with one intra-op thread decoded batch 8 in 4.0 s where two groups on two threads took 6.0 s and
one thread with two intra-op threads 5.1-6.2 s (48 new tokens; the per-step Python work, serialised by
the GIL, doubles with two groups). ``decode_threads=2`` is for an idle machine: measure before choosing.
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable, Optional, TypeVar

import torch

Result = TypeVar("Result")


def split_groups(active: list[int], parts: int) -> list[list[int]]:
    """``active`` (ascending slot ids) cut into ``min(parts, A)`` contiguous groups of near-equal size."""
    parts = max(1, min(parts, len(active)))
    bounds = [len(active) * i // parts for i in range(parts + 1)]
    return [active[bounds[i]:bounds[i + 1]] for i in range(parts)]


class DecodeThreads:
    """``threads`` concurrent decoders, each with ``intra_op_threads`` torch intra-op threads (None: the
    caller's setting, for devices whose ops do not run on host threads). The pool starts on first use and
    stops in :meth:`close` (or when this object is garbage-collected)."""

    def __init__(self, threads: int, intra_op_threads: Optional[int]):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"decode_threads: expected an int >= 1, got {threads!r}")
        self.threads = threads
        self.intra_op_threads = intra_op_threads
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def groups(self, active: list[int]) -> list[list[int]]:
        return split_groups(active, self.threads)

    def map(self, fn: Callable[[list[int]], Result], groups: list[list[int]]) -> list[Result]:
        """``[fn(g) for g in groups]``, the first group on the calling thread, the others on the pool, all
        in inference mode; the first exception is raised after every group finished."""
        futures = [self._executor().submit(self._run, fn, g) for g in groups[1:]]
        try:
            first = self._run(fn, groups[0], restore=True)
        finally:
            concurrent.futures.wait(futures)
        return [first] + [f.result() for f in futures]

    def _run(self, fn: Callable[[list[int]], Result], group: list[int], restore: bool = False) -> Result:
        before = torch.get_num_threads()
        if self.intra_op_threads is not None and before != self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)  # this thread's setting (OpenMP: per-thread)
        try:
            with torch.inference_mode():
                return fn(group)
        finally:
            if restore and torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, self.threads - 1),
                                                               thread_name_prefix="rollout-decode")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
