"""Expert parallelism on Ascend: ``ep_dispatch`` / ``ep_combine`` on torch_npu's MC2 ops
``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``, for rollout decode only (under
``torch.inference_mode``); training and every call outside the documented limits run the reference over HCCL.
Layout work and the limits (with the documentation's statements, and why decode only) live in ``ep_layouts``.

The handle carries the vendor's opaque outputs (assist_info_for_combine, ep_recv_counts) to combine_v2, which
sends the rows back "along the path dispatch collected them". ``rows`` / ``counts`` are the contract's counts and
per-(expert, source rank) rows; the order inside such a block is the vendor's (not documented).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from glm5_core.backends.ascend import ep_layouts as L
from glm5_core.backends.ascend.vendor import Decision, has_operator, on_npu, vendor_ops
from glm5_core.kernel import Kernel
from glm5_core.ops.ep import DispatchHandle, group_rank_size


@dataclasses.dataclass(frozen=True, eq=False)
class VendorDispatchHandle(DispatchHandle):
    """A :class:`DispatchHandle` from dispatch_v2: ``vendor`` holds what combine_v2 needs (expert_ids int32,
    assist_info_for_combine, ep_recv_counts, tp_recv_counts, A, the place)."""

    vendor: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def group_place(group: dist.ProcessGroup, num_tokens: int, device: torch.device) -> L.EPPlace:
    """This rank's EPPlace: the HCCL communicator name of ``group``, the SoC, the servers the group spans
    (LOCAL_WORLD_SIZE ranks a server, as torchrun sets it) and the largest BS of any rank (one all-reduce)."""
    rank, world = group_rank_size(group)
    npu = vendor_ops()
    name = str(npu.npu.get_device_name(device.index if device.index is not None else npu.npu.current_device()))
    comm_name = group._get_backend(device).get_hccl_comm_name(dist.get_global_rank(group, rank))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    bs = torch.tensor([num_tokens, -num_tokens], dtype=torch.int64, device=device)
    dist.all_reduce(bs, op=dist.ReduceOp.MAX, group=group)  # (max BS, -min BS)
    max_bs, min_bs = int(bs[0]), -int(bs[1])
    return L.EPPlace(rank=rank, world=world, comm_name=comm_name, soc=L.soc_generation(name), device=name,
                     server_num=max(1, world // max(1, local)), max_bs=max_bs, min_bs=min_bs)


def dispatch_limits(x, expert_ids, weights, *, group, num_experts: int, place: Optional[L.EPPlace] = None) -> Decision:
    if group is None or group_rank_size(group)[1] < 2:
        return False, f"{L.DISPATCH_OP}: no expert-parallel group (nothing to exchange)"
    if place is None:
        decision = L.decode_only()  # decided before any collective, alike on every rank
        if not decision[0]:
            return decision
        place = group_place(group, x.shape[0], x.device)
    return L.limits(x, expert_ids, num_experts, place)


def dispatch(x, expert_ids, weights, *, group, num_experts: int, npu: Optional[object] = None,
             place: Optional[L.EPPlace] = None) -> VendorDispatchHandle:
    """dispatch_v2, its outputs as a handle: rows [R, H] expert-major, counts int64 [L]."""
    ops = vendor_ops(npu)
    if place is None:
        place = group_place(group, x.shape[0], x.device)
    ids = expert_ids.to(torch.int32).contiguous()
    expand_x, _, assist_info, expert_token_nums, ep_recv_counts, tp_recv_counts = ops.npu_moe_distribute_dispatch_v2(
        x.contiguous(), ids, **L.dispatch_kwargs(place, num_experts))[:6]
    rows, counts = L.contract_rows(expand_x, expert_token_nums)
    empty = torch.empty(0, dtype=torch.int64, device=x.device)
    return VendorDispatchHandle(
        rows=rows, counts=counts, weights=weights, sort_idx=empty, send_splits=(), recv_splits=(), rank_order=None,
        group=group, num_experts=num_experts, rank=place.rank, world_size=place.world,
        vendor=dict(expert_ids=ids, assist_info=assist_info, ep_recv_counts=ep_recv_counts,
                    tp_recv_counts=tp_recv_counts, A=expand_x.shape[0], place=place))


def combine_limits(rows, weights, handle) -> Decision:
    if not isinstance(handle, VendorDispatchHandle):
        return False, f"{L.COMBINE_OP} pairs with {L.DISPATCH_OP}: this handle came from the reference dispatch"
    return True, ""


def combine(rows, weights, handle: VendorDispatchHandle, *, npu: Optional[object] = None) -> torch.Tensor:
    """combine_v2: out[t] = sum_j weights[t, j] * y[(t, j)] back at the source rank. Returns [T, H] in rows' dtype."""
    ops = vendor_ops(npu)
    v = handle.vendor
    out = ops.npu_moe_distribute_combine_v2(
        L.padded_rows(rows, v["A"]), v["expert_ids"], v["assist_info"], v["ep_recv_counts"],
        weights.float().contiguous(), tp_send_counts=v["tp_recv_counts"],
        **L.combine_kwargs(v["place"], handle.num_experts))
    return out.to(rows.dtype)


def _dispatch_supports(x, expert_ids, weights, *, group, num_experts: int, **kwargs) -> Decision:
    decision = on_npu((x, expert_ids, weights))
    if decision[0]:
        decision = has_operator(L.DISPATCH_OP)
    return decision if not decision[0] else dispatch_limits(x, expert_ids, weights, group=group,
                                                            num_experts=num_experts)


def _combine_supports(rows, weights, handle, **kwargs) -> Decision:
    decision = combine_limits(rows, weights, handle)  # a reference handle: decline before anything else
    if decision[0]:
        decision = on_npu((rows, weights))
    return decision


_NOTE = (f"{L.DISPATCH_OP} / {L.COMBINE_OP} for rollout decode only (torch.inference_mode) within their documented "
         f"limits; training runs the reference over HCCL")

KERNELS: Mapping[str, Kernel] = {
    # supports asks the group for its BS range (one all-reduce), then dispatch asks again: two tiny collectives
    # that every rank runs alike, so every rank takes the same path (vendor or reference)
    "ep_dispatch": Kernel(dispatch, supports=_dispatch_supports, note=_NOTE),
    "ep_combine": Kernel(combine, supports=_combine_supports, note=_NOTE),
}
