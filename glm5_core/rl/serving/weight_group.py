"""The process group a trainer broadcasts weights over, SGLang's ``/init_weights_update_group`` contract.

The trainer is rank 0 and hosts the rendezvous (a ``TCPStore`` on ``master_address:master_port``); engine ``i``
joins as rank ``rank_offset`` of ``world_size``. The group is its own ``ProcessGroup`` object (not the default
``torch.distributed`` group), so a trainer that trains with ``torch.distributed`` keeps its default group, and
a group can be torn down and formed again when the engine fleet changes. Each weight tensor goes out as one
broadcast from rank 0, issued asynchronously and waited on together (as SGLang's model runner receives them).

Backends: the distributed backends the vendors declare in their device facts (``gloo`` on CPU tensors, whose
transport binds ``device_host``, and each accelerator vendor's), each group built by its vendor's
``DeviceFacts.process_group`` (a vendor SDK imported only when its group is asked for).
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch

from glm5_core.device_kinds import DIST_BACKEND_NAMES, dist_backends

BACKENDS = DIST_BACKEND_NAMES  # read from the vendors' device facts at each use
DEFAULT_TIMEOUT_S = 300.0


def _process_group(backend: str, store, rank: int, world_size: int, timeout: datetime.timedelta, device_host: str):
    build = dist_backends()[backend].process_group
    if build is None:
        raise ValueError(f"backend: {backend!r} declares no process group for weight updates")
    return build(store, rank, world_size, timeout, device_host)


class WeightUpdateGroup:
    """One member of a weight-update group; rank 0 sends, every other rank receives."""

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S, device_host: Optional[str] = None):
        import torch.distributed as dist

        for name, value, low in (("master_port", master_port, 1), ("world_size", world_size, 2), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r:.80}")
        if master_port > 65535:
            raise ValueError(f"master_port: expected a port <= 65535, got {master_port}")
        if rank >= world_size:
            raise ValueError(f"rank_offset: expected a rank < world_size={world_size}, got {rank}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r:.80}")
        if not isinstance(group_name, str) or not 1 <= len(group_name) <= 128:
            raise ValueError(f"group_name: expected a str of 1 to 128 characters, got {group_name!r:.80}")
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address: expected a host name or address, got {master_address!r:.80}")
        self.rank, self.world_size, self.group_name, self.backend = rank, world_size, group_name, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout,
                                    wait_for_workers=False)
        store = dist.PrefixStore(group_name, self._store)
        host = device_host if device_host is not None else (master_address if rank == 0 else "")
        self._pg = _process_group(backend, store, rank, world_size, timeout, host)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0: send ``tensors``; other ranks: receive into them (same shapes, dtypes, order)."""
        works = [self._pg.broadcast(t, 0) for t in tensors]
        for work in works:
            work.wait()

    def receive(self, shapes: list[list[int]], dtypes: list[torch.dtype], device) -> list[torch.Tensor]:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
        self.broadcast(tensors)
        return tensors

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                pass
        self._store = None
