"""Expert parallelism on NVIDIA GPUs: ``ep_dispatch`` on DeepEP's ``ElasticBuffer.dispatch`` (expand mode,
deterministic), ``ep_combine`` on ``ElasticBuffer.combine`` for rollout only (under ``torch.inference_mode``);
training's combine, and every call DeepEP cannot take, run the reference (``all_to_all_single`` over NCCL).

Read from deepseek-ai/DeepEP at commit dd758caf451848bd150e1046af3d0a73e5fff38d (``deep_ep.__version__`` 2.1.0):
``deep_ep/buffers/elastic.py`` (``ElasticBuffer``, ``EPHandle``, ``EPHandle.deterministic_sort``),
``deep_ep/utils/refs.py`` (``dispatch``: ``src_token_global_idx = src_rank_idx * num_max_tokens_per_rank +
src_token_local_idx``), ``deep_ep/include/deep_ep/impls/combine.cuh`` / ``combine_utils.cuh`` /
``combine_reduce_epilogue.cuh`` (the combine's reduction). ``deep_ep`` is imported inside the kernels only (its
import checks the NCCL library and initialises its JIT): never at ``import glm5_core``.

Dispatch keeps the contract bitwise:
  * ``ElasticBuffer(..., deterministic=True)`` sorts the rows inside each local expert by the source token's global
    index, which is rank-major (refs.py above), padding last; a token names an expert in one slot only, so the
    order is the contract's (source rank, source token, slot). The rows are copies of x: bitwise in any dtype
    DeepEP moves (bf16; fp8 is a quantisation and is not used);
  * the handle is a full :class:`DispatchHandle`: the per-(source rank, local expert) counts come from DeepEP's
    handle (``recv_src_metadata[:, 0]`` the source global index, ``[:, 2:]`` each slot's expanded row), so the
    reference combine and the backward run on it unchanged;
  * backward (a combine of the row gradients without weights): the reference's reverse exchange over NCCL, the
    same torch ops as the reference's backward, so the gradients are bitwise the reference's. DeepEP's combine is
    not used for it (next point).

Combine declines outside ``torch.inference_mode``: ``ElasticBuffer.combine`` takes rows the caller has already
weighted (expand mode sends no weights: ``combine.cuh`` asserts ``topk_weights == nullptr`` for the expanded
send) in bf16, and sums a token's rows unweighted inside the kernel, in bf16 adds when at most two slots are valid
(``enable_hadd_bypass`` in ``combine_utils.cuh``), else in fp32 rounded to bf16 once, over the slots in
``compute_topk_slots`` order. The contract's combine weights in fp32 and sums in fp32 in slot order, so training
keeps the reference; rollout (where a token's result only needs to be deterministic) may take DeepEP's.

Call settings: ``num_sms=0`` (DeepEP picks them: ``get_theoretical_num_sms``; combine reuses the handle's),
``async_with_compute_stream=False`` (the current stream waits for the exchange, so the returned ``EventOverlap`` is
not needed and the deterministic epilogue runs at once), ``do_cpu_sync=True`` (exact received counts: the rows'
count and the splits are Python ints, as the reference's are), ``expert_alignment=1`` (no padding rows).

The ``ElasticBuffer`` is the caller's (its constructor is collective over the group, allocates NVLink / RDMA
buffers and creates an NCCL communicator): build it with :func:`make_buffer` (or yourself, with
``deterministic=True``) on every rank, and run the ops inside ``with use_buffer(buffer):``. Without one the
kernels decline and the reference runs.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from glm5_core.backends.cuda import ep_layouts as L
from glm5_core.kernel import Decision, Kernel
from glm5_core.ops import moe
from glm5_core.ops.ep import DispatchHandle, _expert_major_order, all_to_all_rows, group_rank_size

OK: Decision = (True, "")

# the caller's ElasticBuffer for the calls made inside ``use_buffer`` (per context: threads and tasks do not share)
_BUFFER: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("glm5_cuda_ep_buffer", default=None)


@contextlib.contextmanager
def use_buffer(buffer: Any) -> Iterator[Any]:
    """Run the ``ep_dispatch`` / ``ep_combine`` calls of this block on ``buffer`` (a ``deep_ep.ElasticBuffer``
    built on the group the calls pass, on every rank of it)."""
    for attribute in ("group", "dispatch", "combine", "deterministic", "num_max_tokens_per_rank"):
        if not hasattr(buffer, attribute):
            raise TypeError(f"buffer: expected a deep_ep.ElasticBuffer (with .{attribute}), got "
                            f"{type(buffer).__name__}")
    token = _BUFFER.set(buffer)
    try:
        yield buffer
    finally:
        _BUFFER.reset(token)


def make_buffer(group: dist.ProcessGroup, *, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> Any:
    """``deep_ep.ElasticBuffer`` sized for these settings (``ElasticBuffer.get_buffer_size_hint`` inside its
    constructor), deterministic (the contract's row order) and with one reduction in combine
    (``allow_multiple_reduction=False``: "only one reduction will be done in the combine epilogue for best
    precision"). Collective: call it on every rank of ``group``."""
    for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                        ("num_topk", num_topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    import deep_ep  # lazy: its import checks the NCCL library and initialises its JIT

    if not hasattr(deep_ep, "ElasticBuffer"):
        raise ValueError(f"deep_ep: expected deep_ep >= 2.0 with ElasticBuffer (read at 2.1.0), got "
                         f"{getattr(deep_ep, '__version__', '?')} without it (its V1 Buffer is not wired in)")
    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                                 num_topk=num_topk, deterministic=True, allow_multiple_reduction=False)


@dataclasses.dataclass(frozen=True, eq=False)
class DeepEPDispatchHandle(DispatchHandle):
    """A :class:`DispatchHandle` from ``ElasticBuffer.dispatch``: every field the reference combine needs, and in
    ``vendor`` what ``ElasticBuffer.combine`` needs (the buffer, DeepEP's ``EPHandle``, the expanded rows' count
    and each contract row's expanded row)."""

    vendor: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------------------------- decisions
def buffer_for(group) -> tuple[Optional[Any], str]:
    """The buffer of ``use_buffer`` if it serves ``group``, else (None, why)."""
    buffer = _BUFFER.get()
    if buffer is None:
        return None, ("no DeepEP ElasticBuffer given: run the ep ops inside backends.cuda.ep.use_buffer("
                      "make_buffer(group, ...)) on every rank")
    if buffer.group is not group:
        return None, "the DeepEP ElasticBuffer in use_buffer was built on another process group than this call's"
    return buffer, ""


def _on_gpu(tensors) -> Decision:
    for t in tensors:
        if t.device.type != "cuda":
            return False, f"tensors are on {t.device.type}, DeepEP needs cuda tensors"
    return OK


def dispatch_limits(x, expert_ids, weights, *, group, num_experts: int, buffer=None,
                    max_tokens: Optional[int] = None) -> Decision:
    """Whether DeepEP's dispatch keeps the contract for this call; decided alike on every rank (the dtype is
    agreed by ``ep.dispatch``, the batch by one all-reduce of the largest T)."""
    if group is None or group_rank_size(group)[1] < 2:
        return False, "DeepEP dispatch: no expert-parallel group (nothing to exchange)"
    if buffer is None:
        buffer, why = buffer_for(group)
        if buffer is None:
            return False, why
    decision = L.dispatch_limits(x, deterministic=bool(buffer.deterministic))
    if not decision[0]:
        return decision
    if expert_ids.shape[1] > 32:
        return False, f"DeepEP's combine epilogue takes top-k <= 32 (EP_STATIC_ASSERT), got {expert_ids.shape[1]}"
    if max_tokens is None:
        most = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        max_tokens = int(most)
    if max_tokens > int(buffer.num_max_tokens_per_rank):
        return False, (f"DeepEP dispatch: a rank holds {max_tokens} tokens, the ElasticBuffer was built for "
                       f"num_max_tokens_per_rank={buffer.num_max_tokens_per_rank}")
    return OK


def combine_limits(rows, weights, handle) -> Decision:
    if not isinstance(handle, DeepEPDispatchHandle):
        return False, "DeepEP combine pairs with DeepEP dispatch: this handle came from the reference dispatch"
    if not torch.is_inference_mode_enabled():
        return False, ("DeepEP ElasticBuffer.combine sums caller-weighted bf16 rows (bf16 adds at <= 2 slots, else "
                       "fp32 rounded once), not the contract's fp32 slot-order weighted sum: rollout only (under "
                       "torch.inference_mode), training keeps the reference combine over NCCL")
    if rows.dtype != torch.bfloat16:
        return False, f"DeepEP ElasticBuffer.combine takes bfloat16 rows, got {rows.dtype}"
    return OK


# --------------------------------------------------------------------------------------------- kernels
class _VendorRows(torch.autograd.Function):
    """The rows DeepEP delivered, with the reference's backward: expert-major -> rank-major (the reference's
    index backward: an accumulating index_put on zeros), then the reverse exchange to the sources."""

    @staticmethod
    def forward(ctx, x_sorted, rows, order, send_splits, recv_splits, group):
        ctx.order, ctx.splits, ctx.group = order, (tuple(send_splits), tuple(recv_splits)), group
        ctx.sent = x_sorted.shape[0]
        return rows

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        rank_major = grad.new_zeros(grad.shape).index_put_((ctx.order,), grad, accumulate=True)
        back = all_to_all_rows(rank_major, recv_splits, send_splits, ctx.group)  # [T*K, D], sent order
        return back, None, None, None, None, None


def source_counts(recv_src_metadata: torch.Tensor, num_recv_tokens: int, num_max_tokens_per_rank: int,
                  index: torch.Tensor, counts: torch.Tensor, world: int, expanded_rows: int) -> torch.Tensor:
    """int64 [N, L]: the rows of local expert e from source rank s, from DeepEP's handle (``recv_src_metadata``
    [:, 0] the source global index, rank-major; [:, 2:] the expanded row of each slot, -1 none) and ``index``
    (each contract row's expanded row)."""
    meta = recv_src_metadata[:num_recv_tokens].to(torch.int64)
    slots = meta[:, 2:]  # [n, K]
    valid = slots >= 0
    src_rank = (meta[:, 0] // num_max_tokens_per_rank)[:, None].expand_as(slots)
    row_rank = torch.full((expanded_rows,), -1, dtype=torch.int64, device=meta.device)
    row_rank[slots[valid]] = src_rank[valid]
    rank_of_row = row_rank[index]  # [R]
    if rank_of_row.numel() and int(rank_of_row.min()) < 0:
        raise ValueError("recv_src_metadata: a received row names no source token")
    L_ = counts.numel()
    expert_of_row = torch.repeat_interleave(torch.arange(L_, device=counts.device), counts)
    return torch.bincount(rank_of_row * L_ + expert_of_row, minlength=world * L_).view(world, L_)


def dispatch(x, expert_ids, weights, *, group, num_experts: int, buffer=None) -> DeepEPDispatchHandle:
    """``ElasticBuffer.dispatch(do_expand=True)`` on the buffer of ``use_buffer`` (or ``buffer``): rows [R, D]
    expert-major in the contract's order, counts int64 [L], and every field of the reference's handle."""
    if buffer is None:
        buffer, why = buffer_for(group)
        if buffer is None:
            raise ValueError(f"buffer: {why}")
    rank, world = group_rank_size(group)
    Lx = num_experts // world
    # the source side as the reference builds it (the graph the backward runs through)
    x_sorted, sort_idx, local_counts = moe.dispatch_reference(x, expert_ids, num_experts=num_experts)
    send_splits = tuple(local_counts.view(world, Lx).sum(1).tolist())
    try:
        import deep_ep  # lazy (see the module docstring)
        index_dtype = deep_ep.topk_idx_t
    except ImportError:  # a buffer given without the package: the stand-in of the tests
        index_dtype = torch.int64
    recv_x, _, recv_topk_weights, handle, event = buffer.dispatch(
        x.detach().contiguous(), topk_idx=expert_ids.to(index_dtype).contiguous(),
        topk_weights=weights.detach().float().contiguous(), num_experts=num_experts, do_expand=True,
        expert_alignment=1, do_cpu_sync=True)
    rows, counts = L.expert_rows(recv_x, handle.psum_num_recv_tokens_per_expert,
                                 handle.num_unaligned_recv_tokens_per_expert)
    starts = handle.psum_num_recv_tokens_per_expert.to(torch.int64) - counts
    index = (torch.repeat_interleave(starts, counts) + torch.arange(rows.shape[0], device=rows.device)
             - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts))  # contract row -> expanded row
    recv_counts = source_counts(handle.recv_src_metadata, int(handle.recv_src_metadata.shape[0]),
                                int(handle.num_max_tokens_per_rank), index, counts, world, recv_x.shape[0])
    recv_splits = tuple(recv_counts.sum(1).tolist())
    order = _expert_major_order(recv_counts)  # expert-major row -> rank-major row
    rank_order = torch.empty_like(order)
    rank_order[order] = torch.arange(order.numel(), device=order.device)
    rows = _VendorRows.apply(x_sorted, rows, order, send_splits, recv_splits, group)
    return DeepEPDispatchHandle(
        rows=rows, counts=counts, weights=weights, sort_idx=sort_idx, send_splits=send_splits,
        recv_splits=recv_splits, rank_order=rank_order, group=group, num_experts=num_experts, rank=rank,
        world_size=world,
        vendor=dict(buffer=buffer, handle=handle, expanded_rows=recv_x.shape[0], index=index,
                    recv_topk_weights=recv_topk_weights[index] if recv_topk_weights is not None else None))


def combine(rows, weights, handle: DeepEPDispatchHandle) -> torch.Tensor:
    """Rollout: each row weighted (fp32 product rounded to bf16), put back at its expanded row, then
    ``ElasticBuffer.combine``'s unweighted sum at the source. Returns [T, D] bf16."""
    v = handle.vendor
    w = v["recv_topk_weights"]  # [R] the routing weight of each row (DeepEP sent them with the rows)
    weighted = (rows.float() * w[:, None]).to(torch.bfloat16)
    expanded = rows.new_zeros((v["expanded_rows"], rows.shape[1]), dtype=torch.bfloat16)
    expanded[v["index"]] = weighted
    out, _, event = v["buffer"].combine(expanded, v["handle"])
    return out.to(rows.dtype)


def _dispatch_supports(x, expert_ids, weights, *, group, num_experts: int, **kwargs) -> Decision:
    decision = _on_gpu((x, expert_ids, weights))
    return decision if not decision[0] else dispatch_limits(x, expert_ids, weights, group=group,
                                                            num_experts=num_experts)


def _combine_supports(rows, weights, handle, **kwargs) -> Decision:
    decision = combine_limits(rows, weights, handle)  # a reference handle / training: decline first
    return decision if not decision[0] else _on_gpu((rows, weights))


DISPATCH_NOTE = ("DeepEP ElasticBuffer.dispatch for bf16 calls inside use_buffer(a deterministic buffer) within its "
                 "num_max_tokens_per_rank, bitwise the contract (backward: the reference exchange); else the "
                 "reference over NCCL")
COMBINE_NOTE = ("DeepEP ElasticBuffer.combine for rollout only (torch.inference_mode): it sums caller-weighted bf16 "
                "rows, not the contract's fp32 slot-order sum, so training keeps the reference over NCCL")

KERNELS: Mapping[str, Kernel] = {
    # differentiable: dispatch's backward is the reference's reverse exchange; combine never sees gradients
    # (it declines outside inference mode)
    "ep_dispatch": Kernel(dispatch, supports=_dispatch_supports, differentiable=True, note=DISPATCH_NOTE),
    "ep_combine": Kernel(combine, supports=_combine_supports, note=COMBINE_NOTE),
}
