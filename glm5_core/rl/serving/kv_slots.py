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


def tensors(cache) -> list[torch.Tensor]:
    """Every cached tensor in a fixed order (fields, then layers; ``None`` entries skipped)."""
    out: list[torch.Tensor] = []
    for name in _fields(cache):
        value = getattr(cache, name)
        if isinstance(value, list):
            out.extend(t for t in value if t is not None)
    return out


Cache = TypeVar("Cache")


def row_window(cache: Cache, lo: int, hi: int) -> Cache:
    """The same kind of cache over rows ``[lo, hi)`` of ``cache``: views, so writes land in ``cache``."""
    changes = {name: [None if t is None else t[lo:hi] for t in getattr(cache, name)]
               for name in _fields(cache) if isinstance(getattr(cache, name), list)}
    return dataclasses.replace(cache, **changes)


def read_rows(cache, slot: int, length: int) -> list[torch.Tensor]:
    """Clones of positions ``[0, length)`` of row ``slot``: ``[1, length, W]`` per tensor."""
    return [t[slot:slot + 1, :length].clone() for t in tensors(cache)]


def write_rows(cache, slot: int, rows: list[torch.Tensor], length: int) -> None:
    """Copy the first ``length`` positions of ``rows`` (from :func:`read_rows`) into row ``slot``."""
    stores = tensors(cache)
    assert len(stores) == len(rows), "prefix rows do not match the cache layout"
    for store, row in zip(stores, rows):
        store[slot:slot + 1, :length].copy_(row[:, :length])
