"""Prefix cache keyed by trajectory: the KV rows of a trajectory's last request, reused by its next turn.

A later turn of the same trajectory usually sends the previous context + the previous answer + new
environment tokens; the engine copies the longest common prefix back into a batch slot and prefills only
the rest. Two budgets bound the cache, like a serving engine's KV pool: ``max_entries`` trajectories and
(optionally) ``max_tokens`` cached positions in total, since an entry's memory grows with its length; the
least-recently-used entries are evicted until both hold, and an entry longer than ``max_tokens`` on its own
is not kept. :meth:`drop` frees a trajectory's entry at once (the trajectory ended: its KV is dead). Each
entry records the weight version its KV was computed under (the oldest, if weights changed while it was
generated): the engine flushes the cache when
weights change, does not store KV that predates its current weights, and :meth:`lookup` with
``min_version`` ignores any entry older than that version, so no stale KV is ever reused.

Legend: n cached positions; tensors are ``[1, n, W]`` slices of the model's KV cache, one per cache field.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Optional

import torch


@dataclasses.dataclass
class PrefixEntry:
    tokens: list[int]  # the tokens whose KV is stored (position i holds tokens[i])
    tensors: list[torch.Tensor]  # [1, n, W] per cache field, in the engine's field order
    version: int = 0  # weight version the KV was computed under (the oldest one, if it spans several)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TrajectoryPrefixCache:
    def __init__(self, max_entries: int, max_tokens: Optional[int] = None):
        if not isinstance(max_entries, int) or max_entries < 0:
            raise ValueError(f"prefix_cache_entries: expected an int >= 0, got {max_entries!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
            raise ValueError(f"prefix_cache_tokens: expected None or an int >= 0, got {max_tokens!r}")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[str, PrefixEntry] = collections.OrderedDict()
        self._num_tokens = 0  # cached positions over all entries
        self._lock = threading.Lock()
        self.evictions = 0  # entries pushed out by the budgets (not drops, not replacements)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def _pop(self, key: str) -> Optional[PrefixEntry]:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._num_tokens -= len(entry.tokens)
        return entry

    def store(self, key: str, tokens: list[int], tensors: list[torch.Tensor], version: int = 0) -> None:
        with self._lock:
            self._pop(key)  # the new entry replaces the trajectory's previous one
            if self.max_entries == 0 or (self.max_tokens is not None and len(tokens) > self.max_tokens):
                return
            self._entries[key] = PrefixEntry(list(tokens), tensors, int(version))
            self._num_tokens += len(tokens)
            while len(self._entries) > self.max_entries or (
                    self.max_tokens is not None and self._num_tokens > self.max_tokens):
                self._pop(next(iter(self._entries)))
                self.evictions += 1

    def lookup(self, key: str, input_ids: Sequence[int], min_version: int = 0) -> tuple[int, Optional[PrefixEntry]]:
        """(reusable length, entry): at most ``len(input_ids) - 1`` positions, so the last input token is
        always computed (its logits start the generation). An entry computed under a weight version older
        than ``min_version`` is stale: it is dropped and nothing is reused."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.version < min_version:
                self._pop(key)
                entry = None
            if entry is None:
                return 0, None
            self._entries.move_to_end(key)
        reuse = min(common_prefix_length(entry.tokens, input_ids), len(input_ids) - 1)
        return reuse, (entry if reuse > 0 else None)

    def drop(self, key: str) -> None:
        with self._lock:
            self._pop(key)

    def flush(self) -> None:
        with self._lock:
            self._entries.clear()
            self._num_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)
