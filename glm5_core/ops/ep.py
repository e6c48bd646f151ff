"""Expert parallelism: token dispatch to the ranks that hold the experts, and the weighted combine back.

The ops of this family (``OPS`` at the end declares them), each ``ep_<name>`` with entry point ``<name>`` and
reference ``<name>_reference``:

  ep_dispatch   dispatch   dispatch_reference   x [T, D], ids [T, K], weights [T, K] -> DispatchHandle
  ep_combine    combine    combine_reference    rows [R, D], handle -> [T, D]
  ep_experts    experts    experts_reference    x, ids, weights, w_gate / w_up [L, F, D], w_down [L, D, F] -> [T, D]

``ep_experts`` is the optional fused slot (dispatch + grouped SwiGLU + combine in one call) for vendors whose
fast path fuses the exchange with the GEMMs (MC2-class fused ops, DeepGEMM Mega-MoE). It is a composite (``OpSpec``
``composite`` / ``parts``): a backend without a fused kernel runs its own ``ep_dispatch``, ``moe_experts`` and
``ep_combine`` kernels; its reference composes the three references. The weights are this rank's L experts.

Legend (sizes): T tokens on this rank, K experts per token (top-k), D hidden size, E routed experts in all,
N ranks of the expert-parallel group, L = E / N experts per rank, R rows this rank's experts receive.

Sharding: experts are split contiguously, rank r holds experts [r*L, (r+1)*L). ``num_experts % N == 0``.

Contract (every backend):
  * dispatch sends each (token, slot) assignment to the rank holding its expert. ``handle.rows`` [R, D] are
    the rows this rank's experts receive, EXPERT-MAJOR: local expert 0's rows first, then local expert 1's, ...;
    within an expert ordered by (source rank, source token, slot). ``handle.counts`` int64 [L] holds the rows
    of each local expert (sum R). So the rows of an expert are exactly, in the same order, those a single
    device computing the concatenated batch of the ranks (rank 0's tokens first) gives that expert
    (``moe.dispatch``): an expert's GEMM sees the same matrix with or without expert parallelism.
  * combine takes the experts' outputs in the rows' order, sends each back to its source rank and returns
    out[t] = sum_j weights[t, j] * y[(t, j)], summed in fp32 (fp64 for fp64) in slot order (``moe.combine``).
  * ``group=None`` or a group of size 1: no communication; ``rows`` / ``counts`` are bitwise
    ``moe.dispatch``'s ``x_sorted`` / ``counts`` and combine is bitwise ``moe.combine``.
  * autograd: the backward of dispatch is the reverse exchange followed by the sum of each token's K row
    gradients (a combine without weights), the backward of combine a gather and the forward exchange (a
    dispatch); gradients reach x, the routing weights (through combine) and, through the rows, the experts.
    Every rank of the group must run the backward (it holds collectives), as every rank runs the forward.
  * bad arguments (``num_experts`` not divisible by N, ids out of range, a token naming one expert in two
    slots, tensors on a device the group's backend does not serve, ``num_experts`` / D / dtype differing between
    ranks) raise on EVERY rank: each rank checks its own arguments, then the ranks exchange a fixed-size
    verdict (one all-gather of a few integers) before any data moves, so no rank is left waiting in an exchange.
    The rank whose argument is wrong raises its own ``ValueError`` / ``TypeError``; the others a ``ValueError``
    naming that rank.

The reference exchanges the per-expert counts, then the rows, with ``torch.distributed.all_to_all_single``
(uneven splits), the one transport function :func:`all_to_all_rows`. On gloo (torch 2.13) ``all_to_all_single``
takes uneven splits while the list form ``all_to_all`` refuses tensors of different sizes, so the single form is
the one used on every collective backend.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from glm5_core import device_kinds, registry
from glm5_core.ops import _checks, moe
from glm5_core.opspec import OpSpec

# dtype codes of the cross-rank agreement (a rank whose x has another dtype disagrees)
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(_checks.FLOAT_DTYPES)}


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What :func:`dispatch` returns: the received rows and what :func:`combine` needs to send results back.

    ``rows`` [R, D] expert-major (the contract in the module docstring), ``counts`` int64 [L] rows per local
    expert, ``weights`` [T, K] the routing weights combine applies, ``sort_idx`` int64 [T*K] the source-side
    order of the sent rows (``moe.dispatch``'s: flat assignment ``t * K + j`` of sent row m), ``send_splits`` /
    ``recv_splits`` the rows sent to / received from each rank, ``rank_order`` int64 [R] the expert-major row
    of each received (rank-major) row (None without communication)."""

    rows: torch.Tensor
    counts: torch.Tensor
    weights: torch.Tensor
    sort_idx: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    rank_order: Optional[torch.Tensor]
    group: Optional[dist.ProcessGroup]
    num_experts: int
    rank: int
    world_size: int

    @property
    def local_experts(self) -> int:
        """L = num_experts / world_size."""
        return self.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        """The global id of this rank's local expert 0."""
        return self.rank * self.local_experts


def group_rank_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(rank, world size) of this process in ``group``; (0, 1) for None (no expert parallelism)."""
    if group is None:
        return 0, 1
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return dist.get_rank(group), dist.get_world_size(group)


# --------------------------------------------------------------------------------------------- transport
def all_to_all_rows(rows: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Rows [sum(send_splits), ...] -> [sum(recv_splits), ...]: the i-th block of ``send_splits[i]`` rows goes to
    rank i, the block from rank i arrives i-th. The one transport of the family (``all_to_all_single`` with
    uneven splits, which every collective backend takes)."""
    out = rows.new_empty((int(sum(recv_splits)),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=list(recv_splits),
                           input_split_sizes=list(send_splits), group=group)
    return out


class _Exchange(torch.autograd.Function):
    """:func:`all_to_all_rows` with its backward: the reverse exchange of the gradient (splits swapped)."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (tuple(send_splits), tuple(recv_splits)), group
        return all_to_all_rows(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return all_to_all_rows(grad, recv_splits, send_splits, ctx.group), None, None, None


def _expert_major_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """recv_counts int64 [N, L] (rows from source rank s for local expert e, each source's block sorted by
    expert) -> int64 [R]: the rank-major row of each expert-major row (experts first, then source ranks)."""
    N, L = recv_counts.shape
    device = recv_counts.device
    key = torch.arange(L, device=device)[None, :] * N + torch.arange(N, device=device)[:, None]  # [N, L]: e*N + s
    row_key = torch.repeat_interleave(key.reshape(-1), recv_counts.reshape(-1))  # [R], rank-major
    return torch.sort(row_key, stable=True).indices  # [R]


# --------------------------------------------------------------------------------------------- references
def dispatch_reference(x, expert_ids, weights, *, group, num_experts: int) -> DispatchHandle:
    """Sort locally by expert (``moe.dispatch``), exchange per-expert counts, then rows, then reorder the
    received rows rank-major -> expert-major. Returns a :class:`DispatchHandle`."""
    rank, world = group_rank_size(group)
    x_sorted, sort_idx, counts = moe.dispatch_reference(x, expert_ids, num_experts=num_experts)  # [T*K, D], [T*K], [E]
    if world == 1:
        M = x_sorted.shape[0]
        return DispatchHandle(rows=x_sorted, counts=counts, weights=weights, sort_idx=sort_idx, send_splits=(M,),
                              recv_splits=(M,), rank_order=None, group=group, num_experts=num_experts, rank=0,
                              world_size=1)
    L = num_experts // world
    send_counts = counts.view(world, L)  # [N, L]: rows for rank r's local expert e
    recv_counts = all_to_all_rows(send_counts, [1] * world, [1] * world, group)  # [N, L]: from source s
    send_splits = tuple(send_counts.sum(1).tolist())
    recv_splits = tuple(recv_counts.sum(1).tolist())
    rank_major = _Exchange.apply(x_sorted, send_splits, recv_splits, group)  # [R, D], source blocks
    order = _expert_major_order(recv_counts)  # [R]
    rank_order = torch.empty_like(order)
    rank_order[order] = torch.arange(order.numel(), device=order.device)  # rank-major row -> expert-major row
    return DispatchHandle(rows=rank_major[order], counts=recv_counts.sum(0), weights=weights, sort_idx=sort_idx,
                          send_splits=send_splits, recv_splits=recv_splits, rank_order=rank_order, group=group,
                          num_experts=num_experts, rank=rank, world_size=world)


def combine_reference(rows, weights, handle: DispatchHandle):
    """Reorder expert-major -> rank-major, send each row back to its source, then ``moe.combine`` there.
    Returns [T, D] in rows' dtype."""
    if handle.world_size == 1:
        return moe.combine_reference(rows, handle.sort_idx, weights)
    if rows.shape[0] == 0:
        # nothing came here, so the experts may have returned rows without a graph: tie the result to the
        # dispatch's exchange (an empty sum) so that this rank's backward joins its reverse exchange too
        rows = rows + handle.rows.to(rows.dtype)
    rank_major = rows[handle.rank_order]  # [R, D]
    back = _Exchange.apply(rank_major, handle.recv_splits, handle.send_splits, handle.group)  # [T*K, D], sent order
    return moe.combine_reference(back, handle.sort_idx, weights)


def experts_reference(x, expert_ids, weights, w_gate, w_up, w_down, *, group, num_experts: int):
    """combine(moe.experts(dispatch(x))): the routed FFN with this rank's L experts. Returns [T, D]."""
    handle = dispatch_reference(x, expert_ids, weights, group=group, num_experts=num_experts)
    y = moe.experts_reference(handle.rows, handle.counts, w_gate, w_up, w_down)  # [R, D]
    return combine_reference(y, weights, handle)


def experts_composite(x, expert_ids, weights, w_gate, w_up, w_down, *, group, num_experts: int, backend: str):
    """``ep_experts`` on a backend without a fused kernel: its dispatch, experts and combine kernels (each with
    its own reference fallback). Every rank takes the same path through the parts, so no rank is left alone in
    a collective."""
    handle = registry.call("ep_dispatch", x, expert_ids, weights, group=group, num_experts=num_experts,
                           backend=backend)
    y = registry.call("moe_experts", handle.rows, handle.counts, w_gate, w_up, w_down, backend=backend)
    return registry.call("ep_combine", y, weights, handle, backend=backend)


OPS = (
    OpSpec("ep_dispatch", dispatch_reference, family="ep", differentiable=True),
    OpSpec("ep_combine", combine_reference, family="ep", differentiable=True),
    OpSpec("ep_experts", experts_reference, family="ep", differentiable=True,
           composite=experts_composite, parts=("ep_dispatch", "moe_experts", "ep_combine")),
)


# --------------------------------------------------------------------------------------------- argument checks
def _group_device_types(group: dist.ProcessGroup) -> Optional[tuple[str, ...]]:
    """The device types ``group``'s backend serves (``"cpu:gloo,dev:x"`` names them; a plain backend name is
    looked up in the vendors' device facts), or None when unknown."""
    types: list[str] = []
    for part in str(dist.get_backend(group)).split(","):
        if ":" in part:
            types.append(part.split(":", 1)[0].strip())
            continue
        facts = device_kinds.dist_backends().get(part.strip())
        if facts is None:
            return None
        types.append(facts.device_type)
    return tuple(types)


def _local_problem(x, expert_ids, weights, num_experts, world: int, group) -> Optional[Exception]:
    """This rank's argument error (not raised yet: the ranks first agree), or None."""
    try:
        sizes: dict[str, int] = {}
        _checks.tensor("x", x, dims=("T", "D"), sizes=sizes, legend="[T, D]")
        _checks.tensor("expert_ids", expert_ids, dims=("T", "K"), dtypes=_checks.INDEX_DTYPES, sizes=sizes,
                       legend="[T, K] int32")
        _checks.tensor("weights", weights, dims=("T", "K"), sizes=sizes, legend="[T, K]")
        _checks.same_device(x=x, expert_ids=expert_ids, weights=weights)
        _checks.positive_int("num_experts", num_experts)
        if num_experts % world:
            raise ValueError(f"num_experts: expected a multiple of the expert-parallel group size {world} "
                             f"(experts are sharded contiguously), got {num_experts}")
        if group is not None:
            served = _group_device_types(group)
            if served is not None and x.device.type not in served:
                raise ValueError(f"x: expected a tensor on a device the group's backend "
                                 f"{dist.get_backend(group)!r} serves ({'/'.join(served)}), got {x.device}")
        _checks.index_range("expert_ids", expert_ids, 0, num_experts - 1)
        if _checks.value_checks_enabled() and expert_ids.shape[1] > 1 and expert_ids.numel():
            ordered = torch.sort(expert_ids, dim=1).values  # [T, K]
            repeats = (ordered[:, 1:] == ordered[:, :-1]).any(1)  # [T]
            if bool(repeats.any()):
                t = int(repeats.nonzero()[0, 0])
                raise ValueError(f"expert_ids: expected K distinct experts per token, got token {t} naming "
                                 f"{expert_ids[t].tolist()}")
    except (TypeError, ValueError) as exc:
        return exc
    return None


def _agreement_device(x, group: dist.ProcessGroup) -> torch.device:
    served = _group_device_types(group) or ()
    if isinstance(x, torch.Tensor) and x.device.type in served:
        return x.device
    if "cpu" in served or not served:
        return torch.device("cpu")
    return torch.device(served[0], torch.accelerator.current_device_index())


def _agree(problem: Optional[Exception], x, num_experts, group: dist.ProcessGroup, world: int, rank: int) -> None:
    """One all-gather of (error, num_experts, D, dtype) from every rank; raise on every rank if any rank has a
    bad argument or the ranks disagree."""
    ok_tensor = isinstance(x, torch.Tensor) and x.dim() == 2
    verdict = [int(problem is not None), num_experts if isinstance(num_experts, int) else -1,
               x.shape[1] if ok_tensor else -1, _DTYPE_CODES.get(x.dtype, -1) if ok_tensor else -1]
    mine = torch.tensor(verdict, dtype=torch.int64, device=_agreement_device(x, group))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu().tolist()  # [N, 4]
    if problem is not None:
        raise problem
    bad = [r for r, row in enumerate(table) if row[0]]
    if bad:
        raise ValueError(f"ep.dispatch: rank(s) {bad} of the expert-parallel group rejected their arguments "
                         f"(their errors name them); rank {rank} stops too, no exchange was started")
    for column, what in ((1, "num_experts"), (2, "the hidden size D of x"), (3, "the dtype of x")):
        values = [row[column] for row in table]
        if len(set(values)) > 1:
            shown = values if column != 3 else [str(_checks.FLOAT_DTYPES[v]) for v in values]
            raise ValueError(f"{'num_experts' if column == 1 else 'x'}: expected {what} equal on every rank of the "
                             f"expert-parallel group, got {shown} (by rank)")


# --------------------------------------------------------------------------------------------- entry points
def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, *,
             group: Optional[dist.ProcessGroup], num_experts: int,
             backend: registry.BackendArg = None) -> DispatchHandle:
    """Send each token's K copies to the ranks holding their experts (rank r holds experts
    [r*E/N, (r+1)*E/N)). Returns a :class:`DispatchHandle`: ``rows`` [R, D] expert-major, ``counts`` [E/N].
    ``group=None``: no expert parallelism (bitwise ``moe.dispatch``). Call it on every rank of ``group``."""
    rank, world = group_rank_size(group)
    problem = _local_problem(x, expert_ids, weights, num_experts, world, group)
    if world > 1:
        _agree(problem, x, num_experts, group, world, rank)
    elif problem is not None:
        raise problem
    return registry.call("ep_dispatch", x, expert_ids, weights, group=group, num_experts=num_experts,
                         backend=backend)


def combine(rows: torch.Tensor, handle: DispatchHandle, *, backend: registry.BackendArg = None) -> torch.Tensor:
    """Send the experts' outputs ``rows`` [R, D] (in ``handle.rows``' order) back to their source ranks and sum
    each token's K of them weighted, in fp32 in slot order. Returns [T, D]. Call it on every rank of the group."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle: expected the DispatchHandle returned by ep.dispatch, got {type(handle).__name__}")
    R, D = handle.rows.shape
    _checks.tensor("rows", rows, dims=(R, D), legend=f"[R={R}, D={D}] (the handle's rows)")
    _checks.same_device(rows=rows, weights=handle.weights)
    # the weights go to the kernel as a tensor argument, so the registry sees when they need a gradient
    return registry.call("ep_combine", rows, handle.weights, handle, backend=backend)


def experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
            w_up: torch.Tensor, w_down: torch.Tensor, *, group: Optional[dist.ProcessGroup], num_experts: int,
            backend: registry.BackendArg = None) -> torch.Tensor:
    """The routed FFN across the expert-parallel group in one call: dispatch, this rank's L = E / N SwiGLU experts
    (``w_gate`` / ``w_up`` [L, F, D], ``w_down`` [L, D, F]), combine. Returns [T, D]. A vendor may fuse it (the
    ``ep_experts`` slot); elsewhere it is its backend's dispatch + experts + combine. Call it on every rank."""
    rank, world = group_rank_size(group)
    problem = _local_problem(x, expert_ids, weights, num_experts, world, group)
    if problem is None:
        try:
            L = num_experts // world
            D = x.shape[1]
            _checks.tensor("w_gate", w_gate, dims=(L, None, D), legend=f"[L={L}, F, D={D}] (this rank's experts)")
            F_ = w_gate.shape[1]
            _checks.tensor("w_up", w_up, dims=(L, F_, D), legend=f"[L={L}, F={F_}, D={D}]")
            _checks.tensor("w_down", w_down, dims=(L, D, F_), legend=f"[L={L}, D={D}, F={F_}]")
        except (TypeError, ValueError) as exc:
            problem = exc
    if world > 1:
        _agree(problem, x, num_experts, group, world, rank)
    elif problem is not None:
        raise problem
    return registry.call("ep_experts", x, expert_ids, weights, w_gate, w_up, w_down, group=group,
                         num_experts=num_experts, backend=backend)
