"""The fused ``ep_experts`` slot on Ascend: torch_npu's MC2 fused ops ``npu_alltoallv_gmm`` (AlltoAllv + Permute +
GroupedMatMul, "communication first") for the experts' gate / up GEMM and ``npu_gmm_alltoallv`` (GroupedMatMul +
Unpermute + AlltoAllv, "compute first") for the down GEMM and the way back; the SwiGLU between them and the
weighted combine at the source (fp32, slot order: ``moe.combine``) are ours. Rollout only (``torch.inference_mode``,
as documented); elsewhere, and outside any documented limit, the backend's parts run (dispatch, ``moe_experts``,
combine), each with its own fallback.

Sources: ``op-plugin/docs/context/torch_npu-npu_alltoallv_gmm.md`` and ``torch_npu-npu_gmm_alltoallv.md``; CANN
ops-transformer ``mc2/grouped_mat_mul_allto_allv/docs/aclnnGroupedMatMulAlltoAllv.md`` and
``mc2/allto_allv_grouped_mat_mul/docs/aclnnAlltoAllvGroupedMatMul.md``. Used as documented:

  * ``npu_alltoallv_gmm(gmm_x [BSK, H1], gmm_weight [e, H1, N1], hcom, ep_world_size, send_counts, recv_counts, *,
    trans_gmm_weight)`` -> (gmm_y [A, N1], mm_y, permute_out): ata_out = AlltoAllv(gmm_x), permute_out =
    Permute(ata_out), gmm_y = permute_out x gmm_weight; send_counts / recv_counts are lists of e * ep_world_size
    token counts, A = sum(recv_counts), BSK = sum(send_counts);
  * ``npu_gmm_alltoallv(gmm_x [A, H1], gmm_weight [e, H1, N1], hcom, ep_world_size, send_counts, recv_counts, *,
    trans_gmm_weight)`` -> (y [BSK, N1], mm_y): gmm_y = gmm_x x gmm_weight, y = AlltoAllv(Unpermute(gmm_y)), A =
    sum(send_counts), BSK = sum(recv_counts);
  * limits (both ops): Atlas A3 only; fp16 / bf16; ep_world_size 8, 16, 32 or 64; e <= 32 experts a card and
    e * ep_world_size <= 256; K in [2, 8]; H1, N1 in (0, 65536); BSK in (0, 52428800); a card's communication
    volume in [2 MB, 100 MB]; "supports use in inference scenarios" (no backward is documented).

What the pages leave to the figure of the formula and the callers, and this module assumes (stated by the
stand-in, tests/backends/ascend/mc2_vendor_semantics.py): a counts list is indexed (rank, local expert), rank * e
+ j, as MindSpeed's wrapper reads it (``recv_counts.reshape(ep_world_size, -1).sum(0)`` for the per-expert group
list); Permute turns the received rank-major (source rank, expert) blocks into expert-major (expert, source rank)
blocks, each block's rows kept in order, and Unpermute is its inverse. Under these the rows an expert's GEMM sees
are the contract's (source rank, token, slot); the GEMMs' precision (the gate / up output is rounded to the input
dtype before the SwiGLU, where the reference keeps fp32) is not stated: the slot is checked to the tolerance
table (what the fused slot promises), not bitwise.

The volume of a card is taken as the bytes it sends and receives in each exchange (BSK * H and A * H elements of
the input dtype): every rank checks them on the group's smallest and largest (one count exchange and one
all-reduce), so every rank takes the same path.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable, Optional

import torch
import torch.distributed as dist

from glm5_core.backends.ascend import ep_layouts
from glm5_core.backends.ascend.vendor import Decision, has_operator, on_npu, vendor_ops
from glm5_core.kernel import Kernel
from glm5_core.ops import moe
from glm5_core.ops.ep import all_to_all_rows, group_rank_size

OK: Decision = (True, "")
DISPATCH_GMM = "npu_alltoallv_gmm"
GMM_COMBINE = "npu_gmm_alltoallv"
EP_WORLD_SIZES = (8, 16, 32, 64)
MAX_LOCAL_EXPERTS = 32
MAX_COUNTS = 256  # e * ep_world_size
TOP_K = (2, 8)
MAX_DIM = 65536  # H1, N1 in (0, 65536)
MAX_ROWS = 52428800  # BSK in (0, 52428800)
VOLUME = (2 * 1024 * 1024, 100 * 1024 * 1024)  # a card's communication volume, bytes
DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class MC2Place:
    """This rank in the group: ``comm_name`` (hcom), ``soc`` ("A2" / "A3" / None), and the group's smallest and
    largest rows sent (BSK) and received (A) in the dispatch exchange."""

    rank: int
    world: int
    comm_name: str
    soc: Optional[str]
    device: str
    min_sent: int
    max_sent: int
    min_received: int
    max_received: int


def limits(x, expert_ids, w_gate, w_up, w_down, num_experts: int, place: MC2Place) -> Decision:
    """The documented limits of both ops, checked before the calls; the reason names the limit that failed."""
    op = f"{DISPATCH_GMM} / {GMM_COMBINE}"
    if not torch.is_inference_mode_enabled():
        return False, (f"{op} are documented for inference (no backward): used for rollout only (under "
                       f"torch.inference_mode); training runs dispatch, the experts and combine over HCCL")
    if place.soc != ep_layouts.A3:
        return False, f"{op} are documented for Atlas A3 only, got SoC {place.device!r}"
    if place.world not in EP_WORLD_SIZES:
        return False, f"{op} take ep_world_size in {'/'.join(map(str, EP_WORLD_SIZES))}, got {place.world}"
    if x.dtype not in DTYPES or w_gate.dtype != x.dtype or w_up.dtype != x.dtype or w_down.dtype != x.dtype:
        return False, (f"{op} take x and the expert weights in one dtype of float16/bfloat16, got x {x.dtype}, "
                       f"weights {w_gate.dtype}/{w_up.dtype}/{w_down.dtype}")
    e = num_experts // place.world
    if e > MAX_LOCAL_EXPERTS or num_experts > MAX_COUNTS:
        return False, (f"{op} take e <= {MAX_LOCAL_EXPERTS} experts a card and e * ep_world_size <= {MAX_COUNTS}, "
                       f"got e={e}, e * ep_world_size={num_experts}")
    K = expert_ids.shape[1]
    if not TOP_K[0] <= K <= TOP_K[1]:
        return False, f"{op} take top-k K in [{TOP_K[0]}, {TOP_K[1]}], got K={K}"
    D, F = x.shape[1], w_gate.shape[1]
    for name, value in (("H (hidden size)", D), ("2F (gate and up)", 2 * F), ("F (expert hidden)", F)):
        if not 0 < value < MAX_DIM:
            return False, f"{op} take H1 / N1 in (0, {MAX_DIM}), got {name} = {value}"
    if not (0 < place.min_sent and place.max_sent < MAX_ROWS):
        return False, (f"{op} take BSK (rows a card sends) in (0, {MAX_ROWS}) on every rank, got "
                       f"{place.min_sent} to {place.max_sent}")
    if place.min_received <= 0:
        return False, f"{op}: a rank whose experts receive no row (A = 0) cannot run the grouped matmul"
    row_bytes = D * x.element_size()
    low = min(place.min_sent, place.min_received) * row_bytes
    high = max(place.max_sent, place.max_received) * row_bytes
    if low < VOLUME[0] or high > VOLUME[1]:
        return False, (f"{op} take a card's communication volume in [2 MB, 100 MB], got {low} to {high} bytes "
                       f"(rows sent / received x H x {x.element_size()} bytes)")
    return OK


def exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """send int64 [N, L] (rows for rank r's local expert j) -> recv int64 [N, L] (rows from source s for local
    expert j): the reference's count exchange."""
    world = send.shape[0]
    return all_to_all_rows(send, [1] * world, [1] * world, group)


def group_place(group, x, expert_ids, num_experts: int) -> MC2Place:
    """This rank's MC2Place: one count exchange and one all-reduce over the group."""
    rank, world = group_rank_size(group)
    npu = vendor_ops()
    device = x.device
    name = str(npu.npu.get_device_name(device.index if device.index is not None else npu.npu.current_device()))
    comm_name = group._get_backend(device).get_hccl_comm_name(dist.get_global_rank(group, rank))
    send = torch.bincount(expert_ids.reshape(-1).to(torch.int64), minlength=num_experts).view(world, -1)
    recv = exchange_counts(send, group)
    rows = torch.tensor([int(send.sum()), int(recv.sum())], dtype=torch.int64, device=device)
    both = torch.cat([rows, -rows])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return MC2Place(rank=rank, world=world, comm_name=comm_name, soc=ep_layouts.soc_generation(name), device=name,
                    max_sent=int(both[0]), max_received=int(both[1]), min_sent=-int(both[2]),
                    min_received=-int(both[3]))


def experts(x, expert_ids, weights, w_gate, w_up, w_down, *, group, num_experts: int, npu=None,
            place: Optional[MC2Place] = None,
            exchange: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """The routed FFN with this rank's L experts on the MC2 fused ops. Returns [T, D] in x's dtype."""
    ops = vendor_ops(npu)
    if place is None:
        place = group_place(group, x, expert_ids, num_experts)
    world = place.world
    L = num_experts // world
    if exchange is None:
        def exchange(send):
            return exchange_counts(send, group)
    x_sorted, sort_idx, counts = moe.dispatch_reference(x, expert_ids, num_experts=num_experts)  # rank-major
    send = counts.view(world, L)  # [N, L]: rows for (rank r, its local expert j), index r * L + j
    recv = exchange(send)  # [N, L]: rows from (source s, local expert j)
    send_list, recv_list = send.reshape(-1).tolist(), recv.reshape(-1).tolist()
    F = w_gate.shape[1]
    gate_up = torch.cat([w_gate, w_up], dim=1).contiguous()  # [L, 2F, D]: (e, N1, H1), passed transposed
    h = ops.npu_alltoallv_gmm(x_sorted.contiguous(), gate_up, place.comm_name, world, send_list, recv_list,
                              trans_gmm_weight=True)[0]  # [A, 2F], expert-major
    hidden = moe.swiglu(h[:, :F].float(), h[:, F:].float()).to(x.dtype)  # [A, F]
    y = ops.npu_gmm_alltoallv(hidden.contiguous(), w_down.contiguous(), place.comm_name, world, recv_list,
                              send_list, trans_gmm_weight=True)[0]  # [BSK, D]: x_sorted's rows, back home
    return moe.combine_reference(y, sort_idx, weights)


def _supports(x, expert_ids, weights, w_gate, w_up, w_down, *, group, num_experts: int, **kwargs) -> Decision:
    if not torch.is_inference_mode_enabled():  # decided before any collective, alike on every rank
        return limits(x, expert_ids, w_gate, w_up, w_down, num_experts, None)
    if group is None or group_rank_size(group)[1] < 2:
        return False, f"{DISPATCH_GMM}: no expert-parallel group (nothing to exchange)"
    decision = on_npu((x, expert_ids, weights, w_gate, w_up, w_down))
    for op in (DISPATCH_GMM, GMM_COMBINE):
        if decision[0]:
            decision = has_operator(op)
    if not decision[0]:
        return decision
    return limits(x, expert_ids, w_gate, w_up, w_down, num_experts, group_place(group, x, expert_ids, num_experts))


KERNELS: Mapping[str, Kernel] = {
    # not differentiable: the ops are documented for inference; a call needing gradients runs the parts
    "ep_experts": Kernel(experts, supports=_supports, note=(
        f"{DISPATCH_GMM} + {GMM_COMBINE} for rollout only (documented for inference) on Atlas A3 within their "
        f"documented limits (ep_world_size 8-64, <= 32 experts a card, K 2-8, 2-100 MB a card); else the parts "
        f"(training: dispatch, experts, combine over HCCL)")),
}
