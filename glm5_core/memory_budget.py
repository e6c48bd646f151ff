"""Whether a run's memory fits the machine, decided from its config before anything is allocated.

A run's need is a sum of named parts in bytes (the run configs compute them from ``glm5_core.model.sizing``:
lower bounds, so a run refused here could never have run). It is compared with the machine's physical memory,
read when a config is checked (``GLM5_MEMORY_BYTES`` replaces it, for tests or to leave room for other work).
When a run does not fit, the problem names the key whose value, put back to its default, saves the most.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Callable, Optional

MEMORY_ENV = "GLM5_MEMORY_BYTES"
FLOAT_BYTES = 4  # fp32 weights, gradients, optimizer state and activations
GIB = float(1 << 30)


def machine_memory_bytes() -> int:
    """Physical memory of this machine in bytes, or ``GLM5_MEMORY_BYTES`` when set."""
    override = os.environ.get(MEMORY_ENV)
    if override is not None:
        try:
            value = int(override)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{MEMORY_ENV}: expected a number of bytes >= 1, got {override!r}")
        return value
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf name: read /proc/meminfo (kB)
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    raise ValueError("cannot read this machine's memory size; set GLM5_MEMORY_BYTES")


def gib(size: int) -> str:
    return f"{size / GIB:.3g}" if size < 1 << 1000 else "more than 1e291"  # size / GIB overflows a float


def describe(parts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {gib(size)} GiB" for name, size in parts.items() if size)


def fit_problem(parts: Mapping[str, int], levers: Mapping[str, Callable[[], Mapping[str, int]]],
                default_key: str) -> Optional[str]:
    """None when ``parts`` fit in this machine's memory; else one line naming the key to change.

    ``levers``: key -> the parts with that key back at its default (only keys the config set)."""
    need, have = sum(parts.values()), machine_memory_bytes()
    if need <= have:
        return None
    saved: dict[str, int] = {key: need - sum(parts_at_default().values()) for key, parts_at_default in levers.items()}
    key = max(saved, key=saved.get) if saved and max(saved.values()) > 0 else default_key
    return (f"{key}: the run needs at least {gib(need)} GiB ({describe(parts)}), more than this machine's "
            f"{gib(have)} GiB of memory (counted before allocating; {MEMORY_ENV} overrides the machine's size)")
