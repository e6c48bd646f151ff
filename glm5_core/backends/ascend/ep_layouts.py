"""Argument building, documented limits and result conversion for the expert-parallel vendor ops (pure torch;
tested on CPU against ``tests/backends/ascend/ep_vendor_semantics.py``).

Vendor contract used (``op-plugin/docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md`` and
``torch_npu-npu_moe_distribute_combine_v2.md``; CANN ``aclnnMoeDistributeDispatchV2.md`` /
``aclnnMoeDistributeCombineV2.md``):
  * dispatch_v2(x [BS, H], expert_ids int32 [BS, K], group_ep, ep_world_size, ep_rank_id, moe_expert_num, ...)
    -> (expand_x [A, H], dynamic_scales, assist_info_for_combine [A * 128], expert_token_nums [local experts],
    ep_recv_counts, tp_recv_counts, expand_scales). Without a TP domain expand_x = alltoallv(x) (quant_mode 0:
    no quantisation); A is an upper bound on the rows received (A >= BS * ep_world_size * min(local experts, K)
    for global_bs 0, A >= global_bs * min(local experts, K) otherwise), so only the first sum(expert_token_nums)
    rows hold data. expert_token_nums_type 1: expert_token_nums are per-expert counts (0: a cumulative sum).
    expert_ids values lie in [0, moe_expert_num) and the K of a row are distinct (the same rule as ours).
  * combine_v2(expand_x [A, H], expert_ids, assist_info_for_combine, ep_send_counts (= dispatch's ep_recv_counts),
    expert_scales fp32 [BS, K], same group arguments) -> x [BS, H] = Sum(expert_scales * ataOut), the rows sent
    back "along the path dispatch_v2 collected them" (原路返还).
  * limits: H: A2 (0, 7168] and a multiple of 32, A3 exactly 7168; BS: A2 0 < BS <= 256, A3 0 < BS <= 512;
    K: 0 < K <= 8 and K <= moe_expert_num; A2: server_num (servers of the EP domain) only 2, 4 or 8; x fp16 /
    bf16; global_bs 0 (every rank the same BS) or max BS * ep_world_size.

What the documentation does NOT state, and why these ops serve rollout decode only (``torch.inference_mode``):
  * the order of the rows inside one (local expert, source rank) block of expand_x: the documents say the rows
    are grouped by local expert (expert_token_nums) and received per rank (ep_recv_counts), not in which order a
    source's tokens arrive. Our contract (within an expert: source rank, source token, slot) needs that order,
    and the only per-row record of a row's source, assist_info_for_combine, is documented as "more detailed
    token information" without a layout. So the contract's row ORDER cannot be reproduced from the documented
    outputs; the counts and each block's rows (as a set) can. A token's result does not depend on where its row
    sits in the expert's GEMM when the experts are batch-invariant, which is what rollout decode needs.
  * the precision and order of combine's sum: the formula Sum(expert_scales * ataOut) gives neither. Training
    (gradients, bitwise agreement with the single-device run) therefore stays on the reference over HCCL.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

Decision = tuple[bool, str]
OK: Decision = (True, "")

A2, A3 = "A2", "A3"
SOC_PREFIXES = (("Ascend910_93", A3), ("Ascend910B", A2))  # A3 first: "Ascend910_93xx" is not "Ascend910B"
MAX_HIDDEN = {A2: 7168, A3: 7168}
HIDDEN_MULTIPLE = 32  # A2: H a multiple of 32
A3_HIDDEN = 7168  # A3: H must be exactly 7168
MAX_BS = {A2: 256, A3: 512}
MAX_TOP_K = 8
A2_SERVER_NUMS = (2, 4, 8)
DTYPES = (torch.float16, torch.bfloat16)
NO_QUANT = 0
TOKEN_COUNTS = 1  # expert_token_nums_type 1: counts per local expert, not a cumulative sum
ASSIST_INFO_WIDTH = 128  # assist_info_for_combine is [A * 128]
DISPATCH_OP = "npu_moe_distribute_dispatch_v2"
COMBINE_OP = "npu_moe_distribute_combine_v2"


def soc_generation(device_name: str) -> Optional[str]:
    """"A2" / "A3" from the SoC name (``torch.npu.get_device_name``), None for SoCs the ops do not support."""
    for prefix, generation in SOC_PREFIXES:
        if str(device_name).startswith(prefix):
            return generation
    return None


@dataclasses.dataclass(frozen=True)
class EPPlace:
    """Where this rank sits: what the vendor ops take besides tensors. ``comm_name`` is the HCCL communicator
    name of the EP group (group_ep), ``soc`` "A2" / "A3" (None: unsupported SoC, named in ``device``),
    ``server_num`` the servers the group spans, ``max_bs`` / ``min_bs`` the largest / smallest BS of any rank
    (global_bs, and the BS limit decided alike on every rank so that no rank calls the vendor op alone)."""

    rank: int
    world: int
    comm_name: str
    soc: Optional[str]
    device: str
    server_num: int
    max_bs: int
    min_bs: int


def decode_only() -> Decision:
    """The vendor path serves rollout decode only (the module docstring says why)."""
    if not torch.is_inference_mode_enabled():
        return False, (f"{DISPATCH_OP} is used for rollout decode only (under torch.inference_mode): its documented "
                       f"outputs do not give the contract's row order inside an (expert, source rank) block, nor "
                       f"combine's summation order; training runs the reference over HCCL")
    return OK


def limits(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, place: EPPlace) -> Decision:
    """The documented limits, checked before the call; the reason names the limit that failed. BS is checked on
    the group's smallest and largest BS, so every rank decides alike."""
    op = DISPATCH_OP
    decision = decode_only()
    if not decision[0]:
        return decision
    if place.soc is None:
        return False, f"{op} is documented for Atlas A2 / A3 only, got SoC {place.device!r}"
    if place.world < 2:
        return False, f"{op}: an expert-parallel group of one rank needs no exchange"
    if x.dtype not in DTYPES:
        return False, f"{op} takes x in float16/bfloat16, got {x.dtype}"
    H = x.shape[1]
    K = expert_ids.shape[1]
    if place.soc == A3 and H != A3_HIDDEN:
        return False, f"{op} on Atlas A3 takes hidden size H = {A3_HIDDEN} only, got H={H}"
    if place.soc == A2 and not (0 < H <= MAX_HIDDEN[A2] and H % HIDDEN_MULTIPLE == 0):
        return False, (f"{op} on Atlas A2 takes hidden size H in (0, {MAX_HIDDEN[A2]}] and a multiple of "
                       f"{HIDDEN_MULTIPLE}, got H={H}")
    if not 0 < place.min_bs <= place.max_bs <= MAX_BS[place.soc]:
        return False, (f"{op} on Atlas {place.soc} takes batch size BS in (0, {MAX_BS[place.soc]}] on every rank, "
                       f"got BS from {place.min_bs} to {place.max_bs}")
    if not 0 < K <= min(MAX_TOP_K, num_experts):
        return False, f"{op} takes top-k K in (0, min({MAX_TOP_K}, moe_expert_num={num_experts})], got K={K}"
    if place.soc == A2 and place.server_num not in A2_SERVER_NUMS:
        return False, (f"{op} on Atlas A2 takes an EP group spanning {'/'.join(map(str, A2_SERVER_NUMS))} servers "
                       f"(server_num), got {place.server_num}")
    return OK


def dispatch_kwargs(place: EPPlace, num_experts: int) -> dict[str, object]:
    """Keyword arguments of dispatch_v2 (and, but for the token-count type, of combine_v2): no TP domain, no
    shared-expert ranks, no quantisation, global_bs = max BS * ep_world_size (ranks may hold different BS)."""
    return dict(group_ep=place.comm_name, ep_world_size=place.world, ep_rank_id=place.rank,
                moe_expert_num=num_experts, shared_expert_num=0, shared_expert_rank_num=0, quant_mode=NO_QUANT,
                global_bs=place.max_bs * place.world, expert_token_nums_type=TOKEN_COUNTS)


def combine_kwargs(place: EPPlace, num_experts: int) -> dict[str, object]:
    kwargs = dispatch_kwargs(place, num_experts)
    for name in ("quant_mode", "expert_token_nums_type"):
        kwargs.pop(name)
    return kwargs


def contract_rows(expand_x: torch.Tensor, expert_token_nums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R, H], counts int64 [L]): the first R = sum(expert_token_nums) rows of expand_x (the rest of its A
    rows is buffer), expert-major as the counts say. A view, no copy."""
    counts = expert_token_nums.to(torch.int64)
    R = int(counts.sum())
    if R > expand_x.shape[0]:
        raise ValueError(f"expert_token_nums: expected at most {expand_x.shape[0]} rows in all (expand_x's A), "
                         f"got {R}")
    return expand_x[:R], counts


def padded_rows(rows: torch.Tensor, A: int) -> torch.Tensor:
    """The experts' outputs [R, H] back in expand_x's shape [A, H] for combine_v2 (rows past R are zeros and
    never read: no row of assist_info points there)."""
    if rows.shape[0] == A:
        return rows.contiguous()
    out = rows.new_zeros((A,) + tuple(rows.shape[1:]))
    out[:rows.shape[0]] = rows
    return out
