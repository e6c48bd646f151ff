"""Row-level copies in and out of the model's KVCache (a dataclass of per-layer lists of ``[B, L, W]`` tensors).

The engine keeps one batched cache of ``max_batch`` slots. Requests are prefilled in a separate scratch
cache (one row per request); :func:`write_rows` / :func:`read_rows` copy rows from the prefix cache into
the scratch cache, from the scratch cache into the request's slot, and (cloned) from a finished slot into
the prefix cache. Only the dataclass fields of the cache are touched, so any cache of that shape works.
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch


def _fields(cache) -> list[str]:
    if not dataclasses.is_dataclass(cache):
        raise TypeError(f"cache: expected a dataclass KV cache, got {type(cache).__name__}")
    return [f.name for f in dataclasses.fields(cache)]


def _parts(entry) -> list[torch.Tensor]:
    """A cache entry's tensors: itself, or a per-row state's (a dataclass of [B, ...] tensors: GLM-5.3's KDA
    conv + recurrent state, which has no position axis)."""
    if isinstance(entry, torch.Tensor):
        return [entry]
    return [getattr(entry, f.name) for f in dataclasses.fields(entry)]


def _entries(cache) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, indexed by position) for every cached tensor in a fixed order (fields, then layers)."""
    out: list[tuple[torch.Tensor, bool]] = []
    for name in _fields(cache):
        value = getattr(cache, name)
        if isinstance(value, list):
            for entry in value:
                if entry is not None:
                    out.extend((t, isinstance(entry, torch.Tensor)) for t in _parts(entry))
    return out


def tensors(cache) -> list[torch.Tensor]:
    """Every cached tensor in a fixed order (fields, then layers; ``None`` entries skipped)."""
    return [t for t, _ in _entries(cache)]


Cache = TypeVar("Cache")


def row_window(cache: Cache, lo: int, hi: int) -> Cache:
    """The same kind of cache over rows ``[lo, hi)`` of ``cache``: views, so writes land in ``cache``."""
    def rows(entry):
        if entry is None or isinstance(entry, torch.Tensor):
            return None if entry is None else entry[lo:hi]
        return dataclasses.replace(entry, **{f.name: getattr(entry, f.name)[lo:hi] for f in dataclasses.fields(entry)})

    changes = {name: [rows(t) for t in getattr(cache, name)]
               for name in _fields(cache) if isinstance(getattr(cache, name), list)}
    return dataclasses.replace(cache, **changes)


def read_rows(cache, slot: int, length: int) -> list[torch.Tensor]:
    """Clones of positions ``[0, length)`` of row ``slot``: ``[1, length, W]`` per tensor (a per-row state:
    its whole row, the state after the row's tokens)."""
    return [(t[slot:slot + 1, :length] if positional else t[slot:slot + 1]).clone()
            for t, positional in _entries(cache)]


def write_rows(cache, slot: int, rows: list[torch.Tensor], length: int) -> None:
    """Copy the first ``length`` positions of ``rows`` (from :func:`read_rows`) into row ``slot``."""
    stores = _entries(cache)
    assert len(stores) == len(rows), "prefix rows do not match the cache layout"
    for (store, positional), row in zip(stores, rows):
        if positional:
            store[slot:slot + 1, :length].copy_(row[:, :length])
        else:
            store[slot:slot + 1].copy_(row)
