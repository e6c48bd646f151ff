"""The device types and distributed backends of every known backend, read from their
:class:`~glm5_core.device_facts.DeviceFacts` when asked (so a vendor folder or an out-of-tree vendor package adds
its device type without an edit here or in the code that reads these tables).

Where several backends share a device type (one torch device type driven by several vendors' torch builds), the one
of highest priority whose ``this_torch()`` holds speaks for it (a vendor whose build presents its devices under
another vendor's device type ranks above that vendor, as in auto-detection); when none holds, the first in the
registry's order.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional

from glm5_core import registry
from glm5_core.device_facts import DeviceFacts


def _declared_backends() -> list[registry.Backend]:
    # a backend whose declaration failed to load has no device type of its own ("?")
    return [b for b in registry.backends().values() if b.facts.device_type.isidentifier()]


def _declared() -> list[DeviceFacts]:
    return [b.facts for b in _declared_backends()]


def device_types() -> dict[str, DeviceFacts]:
    """The facts of each known device type, by device type (the host type ``cpu`` first)."""
    by_type: dict[str, list[registry.Backend]] = {}
    for backend in _declared_backends():
        by_type.setdefault(backend.facts.device_type, []).append(backend)
    chosen = {}
    for kind, candidates in by_type.items():
        ranked = sorted(candidates, key=lambda b: -b.priority)  # stable: equal priorities keep the registry's order
        chosen[kind] = next((b.facts for b in ranked if b.facts.this_torch()), candidates[0].facts)
    return chosen


def facts_for(device_type: str) -> Optional[DeviceFacts]:
    """The facts of ``device_type`` (None for a device type no backend declares)."""
    return device_types().get(device_type)


def dist_backends() -> dict[str, DeviceFacts]:
    """The facts that build each known distributed backend's process group, by backend name (``gloo``, ...)."""
    found: dict[str, DeviceFacts] = {}
    for facts in _declared():
        if facts.dist_backend not in found or (found[facts.dist_backend].process_group is None):
            found[facts.dist_backend] = facts
    return found


class DistBackendNames(Sequence):
    """The names of the known distributed backends, read from the registry at each use: what a config's
    ``choices`` or an argument check compares against."""

    def _names(self) -> tuple:
        return tuple(dist_backends())

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, value) -> bool:
        return value in self._names()

    def __repr__(self) -> str:
        return repr(self._names())


DIST_BACKEND_NAMES = DistBackendNames()  # stateless: every read asks the registry
