"""FSDP2 (``fully_shard``) data parallelism for the pretraining driver, and the DTensor helpers around it.

Units (each all-gathers its parameters before its forward, frees them after it, and reduce-scatters its
gradients after its backward):
  * every main decoder layer;
  * apart from its layer, every DSA indexer. Its loss (the KL) leaves the layer through ``ForwardState``,
    not through the layer's output, and its inputs are detached: FSDP's backward hooks, which hang on a
    unit's inputs and outputs, would reshard the layer (and reduce-scatter its gradients) before or after
    the indexer's gradients arrive. As a unit of its own the indexer is gathered again when the gradients
    of its outputs arrive and reduce-scattered at the end of the backward (its inputs need no gradient).
    (Left inside the layer's unit, the backward fails on torch 2.13 with "The tensor has a non-zero number
    of elements, but its data is not allocated yet": the KL's backward reads the freed gathered weights);
  * the MTP module: its decoder body, and apart from it ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm``, because ``MTPLayer.predict`` calls those outside the layer's own ``forward``
    (and the driver calls ``shared_head.norm`` after ``predict`` returns), so FSDP's forward hooks on the
    layer would not cover them;
  * the root: embeddings, the final norm and ``lm_head`` (used by the main head and every MTP depth), kept
    gathered from the root's forward to the end of the backward.
Parameters become DTensors sharded on dim 0 over a 1-D DeviceMesh of every rank (rows that do not divide by
the world size leave the last ranks a shorter or empty shard). Buffers (router biases, rotary frequencies)
stay plain tensors on every rank: the driver keeps them equal by applying the same update everywhere.

Every unit that takes the ``ForwardState`` hands it to the layer as the same object (see
:func:`_pass_dataclasses_through`): FSDP2 would otherwise pass a copy and lose the KL terms layers report.

Stage changes need no re-wrapping: FSDP2 copies each sharded parameter's ``requires_grad`` onto the gathered
parameter at every all-gather, and reduce-scatters only the parameters that received a gradient (the
frozen ones get none), the same set on every rank because every rank trains the same stage.

All of ``torch.distributed`` is imported inside the functions: ``import glm5_core`` does not need it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn


def fully_shard_function() -> Callable:
    """``fully_shard`` of this torch: ``torch.distributed.fsdp`` (torch >= 2.6), else the composable one (2.4, 2.5)."""
    if not torch.distributed.is_available():
        raise ValueError(f"parallel.strategy: 'fsdp2' needs a torch built with torch.distributed; "
                         f"torch {torch.__version__} is not")
    try:
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard
        return fully_shard
    except ImportError:
        raise ValueError(f"parallel.strategy: 'fsdp2' needs torch >= 2.4 (fully_shard; 2.6 or newer "
                         f"recommended), got torch {torch.__version__}") from None


def _dtensor_class():
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def is_dtensor(t) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective: every rank of its mesh must call it); ``t`` itself
    for a plain tensor."""
    return t.full_tensor() if is_dtensor(t) else t


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) laid out as DTensor ``like``: this rank's part, as a DTensor, cut
    locally without communication; ``full`` itself when ``like`` is a plain tensor."""
    if not is_dtensor(like):
        return full
    try:
        from torch.distributed.tensor import distribute_tensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import distribute_tensor
    try:
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    except TypeError:  # torch < 2.6 has no src_data_rank: rank 0 scatters its (equal) copy instead
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of ``model.state_dict()`` that hold one tensor (tied weights), each group in state-dict order.

    Found from ``state_dict(keep_vars=True)``, whose values are the Parameter and buffer objects themselves,
    shared by tied names (FSDP2 sets one sharded Parameter on every module that shares it); plain
    ``state_dict()`` detaches every entry into a fresh tensor, so identities there never match."""
    by_object: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():  # the dict keeps every object alive: ids are unique
        by_object.setdefault(id(t), []).append(name)
    return [names for names in by_object.values() if len(names) > 1]


def stored_name(group: list[str]) -> str:
    """The one name a checkpoint stores a tied group under: the first in sorted order (the name
    ``safetensors.torch.save_model`` keeps, so the file also loads with ``safetensors.torch.load_model``)."""
    return min(group)


def full_state_dict(model: nn.Module, *, keep: bool = True, ep_group=None) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor gathered to its whole tensor, detached, on the CPU.

    A collective under FSDP2: every rank must call it, in the same order. ``keep=False`` (the ranks that do
    not write) gathers each tensor and drops it, so only the writer holds the whole model at once. Every
    name is present; tied names (see :func:`tied_groups`) map to one gathered tensor, gathered once.

    ``ep_group`` (expert parallelism): each rank holds only its experts; a keeping rank gets every expert too,
    one tensor at a time (:func:`iter_full_state`), so a rank that does not keep never holds more than one
    tensor beyond its own shards (for the HF export; checkpoints never do this, see
    ``train/dcp_checkpoint.py``)."""
    if ep_group is not None and torch.distributed.get_world_size(ep_group) > 1:
        out = {}
        for name, whole in iter_full_state(model, ep_group=ep_group):
            if keep:
                out[name] = whole
        return out
    gathered: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in gathered:  # the same collectives on every rank, kept or not
            whole = full_tensor(t.detach()).cpu()
            gathered[id(t)] = whole if keep else None
        if keep:
            out[name] = gathered[id(t)]
    return out


def iter_full_state(model: nn.Module, *, ep_group=None):
    """(name, whole tensor, detached, on the CPU) for every state-dict name of the WHOLE model, in sorted name
    order, one at a time: a collective, every rank of the world must run it to the end. Under expert parallelism
    (``ep_group``) the other ranks' experts are included: each expert tensor is gathered on its owners' mesh and
    broadcast from its owner over the EP group, so no rank ever holds the other ranks' experts at once (the
    digest and the HF export stream through it; before, every rank received every expert in one
    ``all_gather_object``). Tied names give the same tensor (gathered once)."""
    import torch.distributed as dist

    local = model.state_dict(keep_vars=True)
    exchange = ep_group is not None and dist.get_world_size(ep_group) > 1
    owners: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    if exchange:
        mine = {n: (tuple(local[n].shape), local[n].dtype) for n in expert_names(model)}
        listing: list = [None] * dist.get_world_size(ep_group)
        dist.all_gather_object(listing, mine, group=ep_group)
        for r, part in enumerate(listing):
            for n, (shape, dtype) in part.items():
                owners[n] = (r, shape, dtype)
    me = dist.get_rank(ep_group) if exchange else 0
    counts: dict[int, int] = {}
    for t in local.values():
        counts[id(t)] = counts.get(id(t), 0) + 1
    tied: dict[int, torch.Tensor] = {}  # tensors under several names, gathered once
    some = next(iter(local.values()))
    device = (some.to_local() if is_dtensor(some) else some).device  # where this rank's collectives run
    for name in sorted(set(local) | set(owners)):
        if name in owners:
            r, shape, dtype = owners[name]
            if r == me:  # a collective over the mesh of the ranks that hold this expert
                whole = full_tensor(local[name].detach()).contiguous()
            else:
                whole = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(whole, src=dist.get_global_rank(ep_group, r), group=ep_group)
            yield name, whole.cpu()
            continue
        t = local[name]
        if id(t) in tied:
            yield name, tied[id(t)]
            continue
        whole = full_tensor(t.detach()).cpu()
        if counts[id(t)] > 1:
            tied[id(t)] = whole
        yield name, whole


def expert_names(model: nn.Module) -> set[str]:
    """The state-dict names of the expert-parallel layers' local experts."""
    from glm5_core.model.moe import LocalExperts

    return {f"{prefix}.{key}" for prefix, module in model.named_modules() if isinstance(module, LocalExperts)
            for key in module.state_dict().keys()}


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that get their own ``fully_shard``, innermost first (the root comes last, separately)."""
    layers = model.model.main_layers()
    mtp = model.model.mtp
    units: list[nn.Module] = []
    for layer in layers + ([mtp] if mtp is not None else []):
        if layer.self_attn.indexer is not None:
            units.append(layer.self_attn.indexer)
    if mtp is not None:
        units += [mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.shared_head.norm]
    return units + layers + ([mtp] if mtp is not None else [])


class _Boxed:
    """An argument FSDP's hooks must not look into (see :func:`_pass_dataclasses_through`)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _box_one(value):
    return _Boxed(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def _unbox_one(value):
    return value.value if isinstance(value, _Boxed) else value


def _box(module, args, kwargs):
    return tuple(_box_one(a) for a in args), {k: _box_one(v) for k, v in kwargs.items()}


def _unbox(module, args, kwargs):
    return tuple(_unbox_one(a) for a in args), {k: _unbox_one(v) for k, v in kwargs.items()}


def _pass_dataclasses_through(unit: nn.Module) -> None:
    """Hand dataclass arguments (the model's ``ForwardState``) to ``unit`` as the very same object.

    FSDP2's pre-forward hook wraps every input tensor that needs a gradient, looking inside dataclasses
    too, and passes on a *copy* of a dataclass that holds one. Layers report back through ``ForwardState``
    (``kl_terms`` etc.): once an earlier layer's KL term is in it, a later unit would append to a copy and
    its KL would silently drop out of the loss. So each unit boxes such arguments just before FSDP's hook
    (``prepend``) and unboxes them right after it. Tensors inside the state are not this unit's inputs:
    their gradients reach the units that made them through those units' own outputs."""
    unit.register_forward_pre_hook(_box, prepend=True, with_kwargs=True)
    unit.register_forward_pre_hook(_unbox, with_kwargs=True)


def expert_parallel_mesh(device_type: str, world_size: int, ep: int):
    """The 2-D DeviceMesh of expert parallelism, (world / ep, ep) named ("dp_mod_ep", "ep") as torchtitan names
    them: rank ``d * ep + e`` holds the experts of EP rank ``e`` (the "ep" dim: the ranks tokens are exchanged
    between), and the "dp_mod_ep" dim joins the world / ep ranks that hold the same experts (FSDP2 shards
    them there). Refuses an ``ep`` that does not divide the world size, in one line."""
    if world_size % ep:
        raise ValueError(f"parallel.ep: expected a divisor of the world size {world_size}, got {ep}")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))


def expert_units(model: nn.Module) -> list[nn.Module]:
    """The expert-parallel MoE layers' local experts (``LocalExperts``), each an FSDP2 unit of its own."""
    return [layer.experts for layer in model.moe_layers() if layer.expert_parallel]


def shard_model(model: nn.Module, device_type: str, world_size: int, expert_mesh=None) -> nn.Module:
    """Apply FSDP2 to a GLM5ForCausalLM in place (units: see the module docstring); returns it.

    ``expert_mesh`` (expert parallelism, the 1-D "dp_mod_ep" mesh of :func:`expert_parallel_mesh`): each
    layer's local experts become a unit sharded over it instead of over every rank, with gradients divided by
    the world size (not the mesh's size: an expert's gradient already sums the rows of every rank of its EP
    group, so the mean over all ranks' batches is sum / world; torchtitan's ``set_gradient_divide_factor``).
    Needs the default process group (``torchrun``); the model must already be on this rank's device."""
    fully_shard = fully_shard_function()
    from torch.distributed.device_mesh import init_device_mesh

    if not torch.distributed.is_initialized():
        raise ValueError("parallel.strategy: 'fsdp2' needs a process group (run under torchrun with WORLD_SIZE > 1)")
    mesh = init_device_mesh(device_type, (world_size,))
    if expert_mesh is not None:
        for unit in expert_units(model):
            fully_shard(unit, mesh=expert_mesh)
            unit.set_gradient_divide_factor(float(world_size))
            if expert_mesh.size() > 1 and hasattr(unit, "set_force_sum_reduction_for_comms"):
                # a divide factor makes FSDP2 reduce with PREMUL_SUM, which gloo refuses ("Cannot use
                # ReduceOp.PREMUL_SUM with Gloo"): plain sums with the scaling done apart work on every backend
                unit.set_force_sum_reduction_for_comms(True)
    for unit in sharding_units(model):
        fully_shard(unit, mesh=mesh)
        _pass_dataclasses_through(unit)
    fully_shard(model, mesh=mesh)
    return model


@dataclasses.dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` did to a model: ``sharded`` (FSDP2 applied), ``ep_group`` (the process group
    tokens are exchanged over, None without expert parallelism or at ep 1), ``expert_params`` (ids of the
    expert-parallel layers' parameters, for :func:`clip_grad_norm`), and this process's rank / world size."""

    sharded: bool = False
    ep_group: object = None
    expert_params: frozenset = frozenset()
    rank: int = 0
    world_size: int = 1


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where ``parallel.ep`` puts the experts: ``ep_group`` (the process group tokens are exchanged over; None
    for a group of one) and ``expert_mesh`` (the "dp_mod_ep" mesh the experts' FSDP2 units shard over; None on
    one process)."""

    ep_group: object = None
    expert_mesh: object = None


def expert_layout(ep, *, device_type: str, world_size: int) -> Optional[ExpertLayout]:
    """The (world / ep, ep) DeviceMesh of ``parallel.ep`` (:func:`expert_parallel_mesh`), made before the model is
    built so a rank can build only its experts (``GLM5ForCausalLM(expert_shard=...)``); None when ``ep`` is
    unset. On one process every expert stays here: a layout with neither group nor mesh."""
    if ep is None:
        return None
    if world_size % ep:
        raise ValueError(f"parallel.ep: expected a divisor of the world size {world_size}, got {ep}")
    if world_size == 1:
        return ExpertLayout()
    mesh = expert_parallel_mesh(device_type, world_size, ep)
    return ExpertLayout(ep_group=mesh["ep"].get_group() if ep > 1 else None, expert_mesh=mesh["dp_mod_ep"])


def parallelize(model: nn.Module, *, strategy: str, ep, device_type: str, rank: int, world_size: int,
                layout: Optional[ExpertLayout] = None) -> Parallelized:
    """The ``parallel`` section applied to a GLM5ForCausalLM built and initialised alike on every rank (the
    pretraining driver's and the RL trainer's one path): ``ep`` set shards the experts over the "ep" dim of a
    (world / ep, ep) DeviceMesh (``layout``, from :func:`expert_layout` when the caller made it before building;
    on one process every expert stays here, with the batch-invariant kernel), then ``strategy: fsdp2`` on several
    processes applies FSDP2 (:func:`shard_model`), the experts over the mesh's "dp_mod_ep" dim. ``ddp`` is left to
    the caller (it wraps per stage)."""
    if layout is None:
        layout = expert_layout(ep, device_type=device_type, world_size=world_size)
    ep_group = expert_mesh = None
    if layout is not None:
        ep_group, expert_mesh = layout.ep_group, layout.expert_mesh
        model.shard_experts(ep_group)
    sharded = strategy == "fsdp2" and world_size > 1
    if sharded:
        shard_model(model, device_type, world_size, expert_mesh=expert_mesh)
    expert_params = frozenset(id(p) for unit in expert_units(model) for p in unit.parameters())
    return Parallelized(sharded=sharded, ep_group=ep_group, expert_params=expert_params, rank=rank,
                        world_size=world_size)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, *, ep_group=None,
                   expert_params: frozenset = frozenset()) -> torch.Tensor:
    """``clip_grad_norm_`` over plain or DTensor gradients; returns the global 2-norm as a plain tensor.

    With sharded gradients each rank holds part of every gradient: each per-gradient norm is a partial
    DTensor, and gathering their norm gives the norm of the whole gradients on every rank, so every rank
    scales its shards by the same factor (torch's rule: ``min(1, max_norm / (norm + 1e-6))``).

    Expert parallelism: the experts (``expert_params``, ids of parameters) are sharded over another mesh and
    each EP rank holds other experts, so their squared norms are gathered on their own mesh, then summed over
    ``ep_group``; the others' over every rank, as above."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(is_dtensor(g) for g in grads) and ep_group is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if ep_group is None and not expert_params:  # one mesh: as before expert parallelism existed, bit for bit
        norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]  # DTensors, partial over the shards
        total = full_tensor(torch.linalg.vector_norm(torch.stack(norms), 2.0))
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for g in grads:
            g.mul_(coef)
        return total
    by_mesh: dict[tuple[bool, int], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        mesh = p.grad.device_mesh if is_dtensor(p.grad) else None
        by_mesh.setdefault((id(p) in expert_params, id(mesh)), []).append(
            torch.linalg.vector_norm(p.grad, 2.0))  # partial DTensors over a mesh's shards, or plain
    squares = {True: torch.zeros((), dtype=torch.float32), False: torch.zeros((), dtype=torch.float32)}
    for (expert, _), norms in sorted(by_mesh.items(), key=lambda kv: kv[0][0]):  # the same order on every rank
        whole = full_tensor(torch.linalg.vector_norm(torch.stack(norms), 2.0)).float().cpu()
        squares[expert] = squares[expert] + whole * whole
    expert_sq = squares[True]
    if ep_group is not None:
        expert_sq = expert_sq.to(grads[0].device if not is_dtensor(grads[0]) else grads[0].to_local().device)
        torch.distributed.all_reduce(expert_sq, group=ep_group)
        expert_sq = expert_sq.cpu()
    total = torch.sqrt(squares[False] + expert_sq)
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for g in grads:
        g.mul_(coef)
    return total
