"""The process group a trainer broadcasts weights over, SGLang's ``/init_weights_update_group`` contract, joined
exactly as SGLang joins it: one code path for the trainer (rank 0) and for ``glm5 serve`` (ranks 1..), so a trainer
forms its group with SGLang servers and with glm5 serve the same way.

:func:`init_custom_process_group` is sglang 0.5.23 ``python/sglang/srt/utils/common.py``
``init_custom_process_group`` (the same in 0.5.15.post1; "copy from pytorch and OpenRLHF to allow creating
multiple main groups"), called as the model runner calls it
(``python/sglang/srt/model_executor/model_runner_components/weight_updater.py``
``WeightUpdater.init_weights_update_group``: ``init_method="tcp://{master_address}:{master_port}"``,
``rank = rank_offset + tp_rank``, ``world_size``, ``group_name``, ``backend``, torch's default timeout): torch's
``rendezvous`` (rank 0 hosts the ``TCPStore``), a ``PrefixStore(group_name)`` over it, then torch's own
``_new_process_group_helper``, which adds its own key prefixes (``"{group_name}/"``, then ``"{device}/"``), and
the ranks registered in ``_world.pg_group_ranks``. A group built any other way (a raw ``ProcessGroupGloo`` over
``PrefixStore(group_name)``: what glm5-core did before) reads other store keys and never meets SGLang's.
Tensors go out as in ``WeightUpdater.receive_weights_from_distributed``: one ``torch.distributed.broadcast(src=0,
async_op=True)`` per tensor, waited on together; ``destroy_process_group(pg)`` tears a group down
(``destroy_weights_update_group``).

The group is not torch's default group (a trainer that trains with ``torch.distributed`` keeps its own), and a
process needs no default group to hold one. torch names each group once per process (``group_name``), so the two
ends of one group live in two processes, as they do with SGLang. ``gloo``'s transport binds the address torch's
default gloo device picks (the host name's, or ``GLOO_SOCKET_IFNAME``), as in SGLang.
"""
from __future__ import annotations

import datetime

import torch

from glm5_core.device_kinds import DIST_BACKEND_NAMES

BACKENDS = DIST_BACKEND_NAMES  # read from the vendors' device facts at each use
DEFAULT_TIMEOUT_S = 300.0


def tcp_init_method(host: str, port: int) -> str:
    """sglang ``NetworkAddress(host, port).to_tcp()``: ``tcp://host:port``, an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None, device_id=None):
    """sglang 0.5.23 ``sglang/srt/utils/common.py`` ``init_custom_process_group``, line for line (asserts become
    ValueError); ``backend_options`` is torch >= 2.6's name for ``pg_options``."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    if store is not None and init_method is not None:
        raise ValueError("init_method: cannot specify both init_method and store")
    if store is not None:
        if world_size <= 0 or rank < 0:
            raise ValueError(f"world_size, rank: expected > 0 and >= 0 with a store, got {world_size}, {rank}")
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:  # backward compatible API
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        # a PrefixStore avoids accidental overrides of keys used by other systems sharing the store
        store = PrefixStore(group_name, store)
    options = {"backend_options" if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 6)
               else "pg_options": pg_options}
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, **options,
                                      timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def check_group_args(*, master_address, master_port, rank, world_size, group_name, backend) -> None:
    """The arguments of ``/init_weights_update_group`` (one ValueError naming the first wrong one)."""
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


class WeightUpdateGroup:
    """One member of a weight-update group; rank 0 sends, every other rank receives."""

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        check_group_args(master_address=master_address, master_port=master_port, rank=rank, world_size=world_size,
                         group_name=group_name, backend=backend)
        self.rank, self.world_size, self.group_name, self.backend = rank, world_size, group_name, backend
        self._pg = init_custom_process_group(backend=backend, init_method=tcp_init_method(master_address, master_port),
                                             timeout=datetime.timedelta(seconds=timeout_s), world_size=world_size,
                                             rank=rank, group_name=group_name)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0: send ``tensors``; other ranks: receive into them (same shapes, dtypes, order)."""
        import torch.distributed as dist

        if self._pg is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} was closed")
        handles = [dist.broadcast(t, src=0, group=self._pg, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()

    def receive(self, shapes: list[list[int]], dtypes: list[torch.dtype], device) -> list[torch.Tensor]:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
        self.broadcast(tensors)
        return tensors

    def close(self) -> None:
        import torch.distributed as dist

        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                pass
