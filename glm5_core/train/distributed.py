"""Process group setup for ``torchrun`` (one process per device) and the few collectives the driver needs.

The distributed backend comes from the kernel backend's device facts (``DeviceFacts.dist_backend``: gloo on
the cpu backend, each accelerator vendor's own elsewhere).
Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) everything is a no-op.
Gradients are averaged by DistributedDataParallel (``parallel.strategy: ddp``) or reduce-scattered by
FSDP2 (``fsdp2``, see ``fsdp.py``); expert counts are summed so every rank applies the same aux-loss-free
bias update to its (replicated) router-bias buffers.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from glm5_core.device_facts import torch_device_module


@dataclasses.dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name}: expected a non-negative integer in the environment, got {raw!r}")
    return int(raw)


def init_distributed(backend) -> DistContext:
    """Join the torchrun process group for kernel backend ``backend`` (a registry.Backend)."""
    world = _env_int("WORLD_SIZE", 1)
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    device_type = backend.device()
    device = torch.device(device_type) if device_type == "cpu" else torch.device(device_type, local)
    if device_type != "cpu":  # torch.<device_type>: the vendor's, or a privateuse1 plug-in's
        torch_device_module(device_type).set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend.dist_backend, rank=rank, world_size=world)
    return DistContext(rank=rank, world_size=world, local_rank=local, device=device)


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        # Every rank arrives before any tears the group down: a rank that left while rank 0 was still writing
        # the export was sometimes killed at exit ("terminate called without an active exception", gloo).
        dist.barrier()
        dist.destroy_process_group()


def abandon() -> None:
    """After an error: tear the process group down without waiting for the other ranks (a barrier could wait
    forever on a rank that failed elsewhere). Left up, gloo's threads abort the process at interpreter exit
    ("terminate called without an active exception"), which turns a clean ValueError into a SIGABRT."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def mean_across_ranks(values: list[float], ctx: DistContext) -> list[float]:
    """Average a few Python floats over the ranks (NaN-free inputs)."""
    if not ctx.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / ctx.world_size).tolist()


def parameter_digest(model: torch.nn.Module, ep_group=None) -> str:
    """SHA-256 over every parameter and buffer, in name order: equal digests mean bitwise-equal models.

    Sharded (FSDP2) tensors are gathered whole first, so digests compare across strategies and runs; every
    rank must call it then (a collective). ``ep_group``: expert parallelism, every expert is gathered too, one
    tensor at a time (``fsdp.iter_full_state``), so the digest is the whole model's on every rank."""
    from glm5_core.train.fsdp import full_state_dict, iter_full_state

    h = hashlib.sha256()
    if ep_group is not None and dist.get_world_size(ep_group) > 1:  # one whole tensor at a time, name order
        tensors = iter_full_state(model, ep_group=ep_group)
    else:
        tensors = iter(sorted(full_state_dict(model).items()))
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gather_strings(value: str, ctx: DistContext) -> list[str]:
    if not ctx.enabled:
        return [value]
    out: list[str] = [""] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested JSON value as {dotted key: leaf}."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def check_same_on_every_rank(what: str, value: dict[str, Any], ctx: DistContext) -> None:
    """Raise ValueError on every rank unless ``value`` (a JSON-able mapping, e.g. the run's config) is the same
    on all of them, naming the first rank that differs from rank 0 and the keys. A collective.

    Ranks that disagree on a hyper-parameter do not fail on their own: under DDP they step their replicas
    differently (a weight decay of 0.1 on one rank and 0.5 on another ends a run with exit status 0 and
    diverged weights), under FSDP2 each shard moves by its own rank's rule."""
    if not ctx.enabled:
        return
    texts = gather_strings(json.dumps(value, sort_keys=True, default=str), ctx)
    for rank, text in enumerate(texts):
        if text != texts[0]:
            mine, base = _flat(json.loads(text)), _flat(json.loads(texts[0]))
            keys = sorted(k for k in set(mine) | set(base) if mine.get(k, "<absent>") != base.get(k, "<absent>"))
            shown = ", ".join(f"{k}: {base.get(k, '<absent>')!r} on rank 0, {mine.get(k, '<absent>')!r} on rank {rank}"
                              for k in keys[:3])
            raise ValueError(f"{what}: expected the same on every rank; rank {rank} differs from rank 0 in "
                             f"{len(keys)} key(s): {shown}")


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """DDP over the parameters that currently require grad (re-wrap after changing which do)."""
    if not ctx.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None if ctx.device.type == "cpu" else [ctx.device.index]
    # No find_unused_parameters: the trainer makes trainable only what every step of the stage uses (the
    # indexer only in its stages, the MTP module only with MTP depths), so DDP's extra traversal of the
    # autograd graph each step (and the warning it prints on every rank when nothing is unused) is not needed;
    # a parameter left unused would make DDP fail loudly at the next step, never silently skip its gradient.
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=False)
