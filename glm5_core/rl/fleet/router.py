"""DP-aware routing: every request of one trajectory goes to the same engine replica, so the replica's
prefix cache holds the trajectory's previous turns and prefill costs only the new tokens.

Consistent hashing with virtual nodes: each replica owns ``virtual_nodes`` points on a 64-bit ring; a key
goes to the first point clockwise from its hash, skipping unhealthy replicas. Removing a replica moves only
the keys it owned. Light rebalancing: a *new* key whose home replica would hold more than ``imbalance_factor``
times the mean number of live trajectories walks on along the ring to the next replica under that bound; keys
already pinned stay put (their cache lives there). A trajectory is live from its first request until
:meth:`ConsistentHashRouter.forget`, including while its environment step runs between turns: its prefix-cache
entry occupies the replica all that time, so live trajectories (not requests in flight) are what must be
balanced for the replicas' caches to hold them.
"""
from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Iterable
from typing import Optional


def ring_hash(text: str) -> int:
    """Stable 64-bit hash (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class ConsistentHashRouter:
    """Thread-safe trajectory-id -> replica-name router."""

    def __init__(self, replicas: Iterable[str] = (), *, virtual_nodes: int = 150, imbalance_factor: float = 1.5):
        if not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise ValueError(f"virtual_nodes: expected an int >= 1, got {virtual_nodes!r}")
        if not imbalance_factor >= 1.0:
            raise ValueError(f"imbalance_factor: expected a float >= 1.0, got {imbalance_factor!r}")
        self.virtual_nodes = virtual_nodes
        self.imbalance_factor = float(imbalance_factor)
        self._lock = threading.Lock()
        self._points: list[tuple[int, str]] = []  # sorted ring
        self._healthy: dict[str, bool] = {}
        self._load: dict[str, int] = {}
        self._pinned: dict[str, str] = {}  # trajectory id -> replica (sticky after rebalancing)
        for name in replicas:
            self.add_replica(name)

    # -- membership -------------------------------------------------------------------------------------
    def add_replica(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        with self._lock:
            if name in self._healthy:
                self._healthy[name] = True
                return
            for v in range(self.virtual_nodes):
                bisect.insort(self._points, (ring_hash(f"{name}#{v}"), name))
            self._healthy[name] = True
            self._load[name] = 0

    def remove_replica(self, name: str) -> None:
        with self._lock:
            if name not in self._healthy:
                raise ValueError(f"name: unknown replica {name!r}; known: {sorted(self._healthy)}")
            self._points = [p for p in self._points if p[1] != name]
            del self._healthy[name]
            del self._load[name]
            self._pinned = {k: r for k, r in self._pinned.items() if r != name}

    def mark_unhealthy(self, name: str) -> None:
        """Skip ``name`` and unpin its trajectories; idempotent (several failed requests may report one replica)."""
        with self._lock:
            if name in self._healthy:
                self._healthy[name] = False
                self._pinned = {k: r for k, r in self._pinned.items() if r != name}

    def mark_healthy(self, name: str) -> None:
        with self._lock:
            if name in self._healthy:
                self._healthy[name] = True

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return sorted(self._healthy)

    def healthy_replicas(self) -> list[str]:
        with self._lock:
            return sorted(n for n, ok in self._healthy.items() if ok)

    # -- routing ----------------------------------------------------------------------------------------
    def _walk(self, key: str) -> list[str]:
        """Distinct healthy replicas in ring order starting at the key's hash."""
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, (ring_hash(key), ""))
        seen: list[str] = []
        for i in range(len(self._points)):
            name = self._points[(start + i) % len(self._points)][1]
            if name not in seen and self._healthy.get(name):
                seen.append(name)
                if len(seen) == len(self._healthy):
                    break
        return seen

    def home(self, key: str) -> Optional[str]:
        """The replica the ring alone assigns (no pinning, no rebalancing); None when none is healthy."""
        with self._lock:
            walk = self._walk(key)
            return walk[0] if walk else None

    def acquire(self, key: str) -> str:
        """Pick the replica for one request of trajectory ``key`` and count it as in flight."""
        with self._lock:
            name = self._pinned.get(key)
            if name is None or not self._healthy.get(name):
                walk = self._walk(key)
                if not walk:
                    raise RuntimeError("router: no healthy replica")
                name = walk[0]
                live = self._live_counts()
                total = sum(live[n] for n in walk)
                bound = self.imbalance_factor * (total + 1) / len(walk)
                for candidate in walk:
                    if live[candidate] + 1 <= bound:
                        name = candidate
                        break
                self._pinned[key] = name
            self._load[name] += 1
            return name

    def _live_counts(self) -> dict[str, int]:
        """Live (pinned) trajectories per replica; the caller holds the lock."""
        live = {name: 0 for name in self._healthy}
        for name in self._pinned.values():
            live[name] += 1
        return live

    def live_trajectories(self) -> dict[str, int]:
        """Trajectories pinned to each replica (first request seen, not yet forgotten)."""
        with self._lock:
            return self._live_counts()

    def release(self, key: str, name: str) -> None:
        with self._lock:
            if name in self._load and self._load[name] > 0:
                self._load[name] -= 1

    def forget(self, key: str) -> None:
        """The trajectory finished: drop its pin."""
        with self._lock:
            self._pinned.pop(key, None)

    def load(self) -> dict[str, int]:
        """Requests in flight per replica."""
        with self._lock:
            return dict(self._load)


class RoundRobinRouter:
    """Baseline: requests go to replicas in turn, ignoring the trajectory (what DP-aware routing beats)."""

    def __init__(self, replicas: Iterable[str] = ()):
        self._lock = threading.Lock()
        self._names: list[str] = list(replicas)
        self._next = 0

    def add_replica(self, name: str) -> None:
        with self._lock:
            if name not in self._names:
                self._names.append(name)

    def remove_replica(self, name: str) -> None:
        with self._lock:
            self._names.remove(name)

    def mark_unhealthy(self, name: str) -> None:
        """Take ``name`` out of the rotation; idempotent (several failed requests may report one replica)."""
        with self._lock:
            if name in self._names:
                self._names.remove(name)

    def mark_healthy(self, name: str) -> None:
        self.add_replica(name)

    def healthy_replicas(self) -> list[str]:
        with self._lock:
            return list(self._names)

    def acquire(self, key: str) -> str:
        with self._lock:
            if not self._names:
                raise RuntimeError("router: no healthy replica")
            name = self._names[self._next % len(self._names)]
            self._next += 1
            return name

    def release(self, key: str, name: str) -> None:
        return None

    def forget(self, key: str) -> None:
        return None


def build_router(rollout):
    """The router ``rollout.routing`` names: ``dp_aware`` (consistent hashing with ``virtual_nodes`` and
    ``imbalance_factor``) or ``round_robin``."""
    if rollout.routing == "dp_aware":
        return ConsistentHashRouter(virtual_nodes=rollout.virtual_nodes, imbalance_factor=rollout.imbalance_factor)
    return RoundRobinRouter()
