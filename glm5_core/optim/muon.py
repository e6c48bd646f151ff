"""Muon: momentum, then Newton-Schulz orthogonalisation of each matrix update, batched by shape.

Legend: p [rows, cols] a parameter; U its momentum update; with Muon Split a projection is cut into H
per-head blocks (``split_heads``), blocks [H, d, n] (row split) or [H, m, d] (column split), and each
block is orthogonalised and scaled on its own.

One step for a parameter p with gradient g (decoupled weight decay, as AdamW):
    buf = lerp(buf, g, 1 - momentum)                     (an EMA of gradients)
    U   = lerp(g, buf, momentum) if nesterov else buf
    O   = orthogonalize(U) per matrix (per head block with Muon Split), iterated in ``ns_dtype``
    p   = p * (1 - lr * weight_decay) - lr * scale(O's matrix shape) * O

Scale modes (the shape is the matrix that was orthogonalised, i.e. the head block under Muon Split):
    "match_rms_adamw" (Moonlight)      0.2 * sqrt(max(rows, cols))  -> update RMS ~0.2, AdamW's lr/decay work
    "original" (Keller Jordan / torch) sqrt(max(1, rows / cols))
Every parameter group may set ``split_heads`` (H) and ``split_dim`` (0: row blocks, 1: column blocks), and
``ns_dtype``: "float32" (the default: Newton-Schulz in fp32, fp64 for fp64 parameters), "bfloat16" (iterated
in bf16 as torch.optim.Muon does; ``glm5_core.ops.muon`` states the rounding) or "auto" (bf16 where the
parameters' device runs bf16 GEMMs natively, ``ops.muon.native_bf16_gemm``, asked at each step).
Matrices of one shape are stacked and orthogonalised in one batched call.

Sharded parameters (DTensors, e.g. under FSDP2): Newton-Schulz needs whole matrices (and Muon Split whole
head blocks), so for dim-0 shards over a 1-D mesh each matrix is gathered whole on one owner rank
(round-robin within a bucket), orthogonalised there with the owner's other matrices of that shape, and
scattered back as row shards (:class:`RowShards`); any other DTensor layout is gathered on every rank.
Momentum, weight decay and the update itself stay elementwise on the local shards.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Optional

import torch

from glm5_core import registry
from glm5_core.ops import _checks
from glm5_core.ops import muon as muon_ops

SCALE_MODES = ("match_rms_adamw", "original")


def update_scale(rows: int, cols: int, mode: str = "match_rms_adamw") -> float:
    """Multiplier of an orthogonalised [rows, cols] update (see the module docstring)."""
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"scale_mode: expected one of {', '.join(SCALE_MODES)}, got {mode!r}")


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """A parameter seen as a matrix: [rows, prod(rest)] (conv kernels and the like are flattened)."""
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def _check_hyper(name: str, value, lo: float, hi: float = math.inf, *, hi_open: bool = False) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = is_number and lo <= value and (value < hi if hi_open else value <= hi)
    if not ok:
        bracket = ")" if hi_open else "]"
        raise ValueError(f"{name}: expected a number in [{lo}, {hi}{bracket}, got {value!r}")


class Muon(torch.optim.Optimizer):
    """Muon for 2-D (or flattened) hidden weight matrices; see the module docstring.

    Group options: lr, momentum, nesterov, weight_decay, ns_steps, coefficients (name or (a, b, c) triples),
    ns_dtype ("float32", "bfloat16", "auto" or a torch dtype), scale_mode, split_heads (None or H), split_dim
    (0 or 1). ``backend`` selects the orthogonalisation kernel.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = muon_ops.DEFAULT_STEPS,
                 coefficients="polar_express", scale_mode: str = "match_rms_adamw",
                 split_heads: Optional[int] = None, split_dim: int = 0, backend: Optional[str] = None,
                 ns_dtype="float32"):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                        coefficients=coefficients, scale_mode=scale_mode, split_heads=split_heads,
                        split_dim=split_dim, ns_dtype=ns_dtype)
        super().__init__(params, defaults)  # validates every group through add_param_group
        self.backend = backend
        self.kernels = registry.bind(backend)  # resolved once, here

    # Group options added after state dicts were first saved, with the value those runs used: a loaded group
    # without one gets it (torch's load_state_dict puts the saved groups in place of the constructor's).
    KEYS_SINCE = (("ns_dtype", "float32"),)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.KEYS_SINCE:
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the checks the constructor makes (a group added later is held to the same rules)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise
        group["ns_dtype"] = muon_ops.compute_dtype_name(group["ns_dtype"])  # a name: state_dict stays JSON

    @staticmethod
    def _check_group(group: dict) -> None:
        """A group's own values (they override the constructor's defaults) and its parameters."""
        _check_hyper("lr", group["lr"], 0.0)
        _check_hyper("momentum", group["momentum"], 0.0, 1.0, hi_open=True)
        _check_hyper("weight_decay", group["weight_decay"], 0.0)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov: expected a bool, got {type(group['nesterov']).__name__} {group['nesterov']!r}")
        _checks.positive_int("ns_steps", group["ns_steps"])
        update_scale(1, 1, group["scale_mode"])  # validates the mode
        muon_ops.coefficients_for(group["coefficients"])  # validates the schedule
        muon_ops.compute_dtype_name(group["ns_dtype"], "ns_dtype")  # validates the compute dtype
        for p in group["params"]:
            if p.dim() < 2:
                raise ValueError(f"params: Muon needs matrices (rank >= 2), got a parameter of shape {tuple(p.shape)}; "
                                 "give vectors to AdamW")
        heads = group["split_heads"]
        if heads is None:
            return
        if group["split_dim"] not in (0, 1):
            raise ValueError(f"split_dim: expected 0 (row blocks) or 1 (column blocks), got {group['split_dim']!r}")
        for p in group["params"]:
            size = as_matrix(p).shape[group["split_dim"]]
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or size % heads:
                raise ValueError(f"split_heads: expected a positive int dividing dim {group['split_dim']} of "
                                 f"shape {tuple(p.shape)}, got {heads!r}")

    def _momentum_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        grad = p.grad
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1.0 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    @staticmethod
    def _blocks(update: torch.Tensor, group: dict) -> torch.Tensor:
        """The matrices to orthogonalise, stacked: [n_blocks, m, n]."""
        matrix = as_matrix(update)
        if group["split_heads"] is None:
            return matrix.unsqueeze(0)  # [1, rows, cols]
        return muon_ops.split_heads(matrix, group["split_heads"], dim=group["split_dim"])  # [H, d, n] or [H, m, d]

    @staticmethod
    def _block_shape(shape: torch.Size, group: dict) -> tuple[int, int]:
        """The shape of the matrices ``_blocks`` cuts a parameter of ``shape`` into (no tensor needed)."""
        rows, cols = shape[0], math.prod(shape[1:])
        heads = group["split_heads"]
        if heads is None:
            return rows, cols
        return (rows // heads, cols) if group["split_dim"] == 0 else (rows, cols // heads)

    def _orthogonalized(self, members: list[tuple[torch.Tensor, torch.Tensor]], group: dict
                        ) -> dict[int, torch.Tensor]:
        """Whole updates [(param, update in param's shape)] of one block shape -> {id(param): orthogonalised
        update in the param's shape and dtype}, all blocks stacked into one batched call."""
        if not members:
            return {}
        blocks = [self._blocks(update, group) for _, update in members]
        stacked = torch.cat(blocks, dim=0)  # [sum of blocks, m, n]
        ortho = muon_ops.orthogonalize(stacked, steps=group["ns_steps"], coefficients=group["coefficients"],
                                       compute_dtype=group["ns_dtype"], backend=self.kernels)
        out: dict[int, torch.Tensor] = {}
        for (p, _), mine in zip(members, torch.split(ortho, [b.shape[0] for b in blocks])):  # mine [n, m, n_cols]
            matrix = mine[0] if group["split_heads"] is None else muon_ops.merge_heads(mine, dim=group["split_dim"])
            out[id(p)] = matrix.reshape(p.shape).to(p.dtype)
        return out

    @staticmethod
    def _apply(target: torch.Tensor, update: torch.Tensor, group: dict, scale: float) -> None:
        target.mul_(1.0 - group["lr"] * group["weight_decay"])
        target.add_(update, alpha=-group["lr"] * scale)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            # One bucket per block shape (and dtype/device): its blocks are orthogonalised in one batched call.
            buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("params: Muon does not support sparse gradients")
                buckets[(self._block_shape(p.shape, group), p.dtype, p.device)].append(
                    (p, self._momentum_update(p, group)))
            for (shape, _, _), members in buckets.items():
                self._step_bucket(members, group, update_scale(shape[0], shape[1], group["scale_mode"]))
        return loss

    def _step_bucket(self, members: list[tuple[torch.Tensor, torch.Tensor]], group: dict, scale: float) -> None:
        """Orthogonalise and apply the updates of one bucket: plain parameters here; parameters sharded on
        dim 0 (FSDP2) by owner ranks, each orthogonalising whole matrices of its share (:class:`RowShards`);
        other DTensor layouts gathered whole on every rank."""
        plain, other = [], []
        sharded: dict[int, RowShards] = {}  # per process group
        for p, update in members:
            layout = ShardedRows.of(p)
            if layout is not None:
                sharded.setdefault(id(layout.group), RowShards()).add(p, update.to_local(), layout)
            elif _is_dtensor(p):
                other.append((p, update))
            else:
                plain.append((p, update))
        whole = list(plain) + [(p, update.full_tensor()) for p, update in other]
        for shards in sharded.values():
            whole += shards.gather_to_owners()  # this rank's share, whole
        ortho = self._orthogonalized(whole, group)
        for p, _ in plain:
            self._apply(p, ortho[id(p)], group, scale)
        for p, _ in other:
            self._apply(p, _local_part(ortho[id(p)], p), group, scale)
        for shards in sharded.values():
            for p, local in shards.scatter_from_owners(ortho):
                self._apply(p.to_local(), local, group, scale)


# ---------------------------------------------------------------------------------- sharded parameters


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


def _local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (equal on every rank) laid out as DTensor ``like``, cut locally without communication."""
    try:
        from torch.distributed.tensor import distribute_tensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import distribute_tensor
    try:
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    except TypeError:  # torch < 2.6 has no src_data_rank: rank 0 scatters its (equal) copy instead
        return distribute_tensor(full, like.device_mesh, like.placements)


class ShardedRows:
    """The layout of a DTensor parameter sharded on dim 0 over a 1-D mesh (FSDP2's): rows split as
    ``torch.chunk`` splits them, ``chunk = ceil(rows / world)`` per rank, the last ranks shorter or empty."""

    def __init__(self, group, rank: int, world_size: int, p: torch.Tensor, local_rows: int):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.rows, self.trailing = p.shape[0], tuple(p.shape[1:])
        self.chunk = -(-self.rows // world_size)
        self.local_rows = local_rows
        expected = max(0, min(self.chunk, self.rows - rank * self.chunk))
        assert local_rows == expected, f"shard of {local_rows} rows, torch.chunk layout gives {expected}"

    @classmethod
    def of(cls, p: torch.Tensor) -> Optional[ShardedRows]:
        if not _is_dtensor(p) or p.device_mesh.ndim != 1 or len(p.placements) != 1:
            return None
        placement = p.placements[0]
        if not (placement.is_shard() and placement.dim == 0):
            return None
        import torch.distributed as dist

        group = p.device_mesh.get_group(0)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), p, p.to_local().shape[0])

    @property
    def padded_numel(self) -> int:
        return self.chunk * math.prod(self.trailing)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """Up to ``chunk`` rows [n, ...] -> [chunk * prod(trailing)], zero rows appended."""
        out = rows.new_zeros((self.chunk,) + self.trailing)  # [chunk, ...]
        out[:rows.shape[0]] = rows
        return out.reshape(-1)


class RowShards:
    """Muon on dim-0 shards (Moonlight's distributed Muon, with the Newton-Schulz work spread): the k-th
    parameter of a bucket is owned by rank ``k % world``. ``gather_to_owners`` brings every owner the whole
    updates of its parameters, ``scatter_from_owners`` sends every rank its rows of the orthogonalised
    results. Each direction is one ``all_to_all_single`` carrying all of a bucket's matrices: rank r's
    piece for rank k is r's shards of k's matrices, each padded to ``chunk`` rows, concatenated (and the
    reverse for the results). So a bucket costs 2 collectives whatever its size and the world size, each
    matrix crosses the network twice, and each rank orthogonalises ~1/world of the matrices. (All-to-all
    with uneven splits, which every vendor's distributed backend has, rather than per-owner gather and scatter:
    some emulate gather with an all-gather, world times the traffic, and may lack scatter.)

    Legend: W world size, S_k the numel of owner k's matrices padded to ``chunk`` rows (same on every rank)."""

    def __init__(self):
        self.members: list[tuple[torch.Tensor, torch.Tensor, ShardedRows]] = []  # (param, local update, layout)

    def add(self, p: torch.Tensor, local_update: torch.Tensor, layout: ShardedRows) -> None:
        self.members.append((p, local_update, layout))

    @property
    def _layout(self) -> ShardedRows:
        return self.members[0][2]

    def _owned_by(self, owner: int) -> list[tuple[torch.Tensor, torch.Tensor, ShardedRows]]:
        return self.members[owner::self._layout.world_size]

    def _owned_sizes(self, owner: int) -> list[int]:
        """Padded numel of each matrix ``owner`` owns."""
        return [layout.padded_numel for _, _, layout in self._owned_by(owner)]

    def _all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        import torch.distributed as dist

        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                               group=self._layout.group)
        return recv

    def gather_to_owners(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(param, whole update [rows, ...])] for the parameters this rank owns."""
        first = self._layout
        world, me = first.world_size, first.rank
        send = torch.cat([layout.pad(local) for owner in range(world)
                          for _, local, layout in self._owned_by(owner)])  # [S_0 + ... + S_{W-1}]
        mine_sizes = self._owned_sizes(me)
        recv = self._all_to_all(send, [sum(self._owned_sizes(k)) for k in range(world)],
                                [sum(mine_sizes)] * world)  # [W * S_me]: every rank's shards of my matrices
        per_rank = [part.split(mine_sizes) for part in recv.split(sum(mine_sizes))] if mine_sizes else []
        mine: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (p, _, layout) in enumerate(self._owned_by(me)):
            whole = torch.cat([pieces[i].view((layout.chunk,) + layout.trailing) for pieces in per_rank])
            mine.append((p, whole[:layout.rows]))  # [W * chunk, ...] -> [rows, ...]
        return mine

    def scatter_from_owners(self, ortho: dict[int, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``ortho``: {id(param): whole result} for the parameters this rank owns -> [(param, this rank's
        rows of its result [local_rows, ...])] for every parameter of the bucket."""
        first = self._layout
        world, me = first.world_size, first.rank
        owned = self._owned_by(me)
        sent = [layout.pad(ortho[id(p)][r * layout.chunk:(r + 1) * layout.chunk])
                for r in range(world) for p, _, layout in owned]
        send = torch.cat(sent) if sent else self.members[0][1].new_empty(0)  # [W * S_me]: rank r's rows, by r
        owner_sizes = [self._owned_sizes(k) for k in range(world)]
        recv = self._all_to_all(send, [sum(owner_sizes[me])] * world,
                                [sum(sizes) for sizes in owner_sizes])  # [S_0 + ... + S_{W-1}]: my rows, by owner
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for owner, from_owner in enumerate(recv.split([sum(sizes) for sizes in owner_sizes])):
            for (p, _, layout), piece in zip(self._owned_by(owner), from_owner.split(owner_sizes[owner])):
                out.append((p, piece.view((layout.chunk,) + layout.trailing)[:layout.local_rows]))
        return out


def muon_reference_step(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float, momentum: float,
                        nesterov: bool, weight_decay: float, ns_steps: int, coefficients, scale_mode: str,
                        split_heads: Optional[int] = None, split_dim: int = 0,
                        ns_dtype="float32") -> tuple[torch.Tensor, torch.Tensor]:
    """One Muon step on one parameter, written plainly (one head at a time, no batching): the spec the
    optimizer is tested against. Returns (new p, new momentum buffer)."""
    schedule = muon_ops.coefficients_for(coefficients)
    compute_dtype = muon_ops.compute_dtype_for(ns_dtype, p.device)
    buf = buf + (grad - buf) * (1.0 - momentum)
    update = grad + (buf - grad) * momentum if nesterov else buf
    matrix = as_matrix(update)  # [rows, cols]: a conv-like [rows, ...] parameter is one flattened matrix
    if split_heads is None:
        heads = [matrix]
    else:
        heads = list(torch.chunk(matrix, split_heads, dim=split_dim))
    parts = []
    for block in heads:
        ortho = muon_ops.orthogonalize_reference(block, steps=ns_steps, coefficients=schedule,
                                                 compute_dtype=compute_dtype)
        parts.append(ortho * update_scale(block.shape[0], block.shape[1], scale_mode))
    step = parts[0] if split_heads is None else torch.cat(parts, dim=split_dim)
    return p * (1.0 - lr * weight_decay) - lr * step.reshape(p.shape), buf

