"""Executable statement of the documented semantics of torch_npu's ``npu_moe_distribute_dispatch_v2`` /
``npu_moe_distribute_combine_v2``, on simulated ranks in one process (one thread per rank, a barrier where the
real ops exchange). Written from ``op-plugin/docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md`` /
``..._combine_v2.md`` and CANN ``aclnnMoeDistributeDispatchV2.md`` (none of glm5-core's code inside):

  * argument contract: x fp16/bf16 [BS, H]; expert_ids int32 [BS, K], values in [0, moe_expert_num), the K of a
    row distinct; H: A2 (0, 7168] multiple of 32, A3 7168; BS: A2 (0, 256], A3 (0, 512]; 0 < K <= 8, K <=
    moe_expert_num; quant_mode 0 takes no scales; global_bs 0 (every rank the same BS) or max BS * ep_world_size;
    group_ep a name of length [1, 128); moe_expert_num a multiple of ep_world_size (no shared-expert ranks).
  * dispatch: expand_x [A, H], A = global_bs * min(L, K) (BS * world * min(L, K) for global_bs 0), the received
    rows grouped by local expert (expert_token_nums, type 1 counts / 0 cumulative), each expert's rows by source
    rank (ep_recv_counts); rows past the received ones hold garbage (NaN here). assist_info_for_combine [A * 128]
    is this stand-in's own record of (source rank, token, slot) per row (the documents give no layout; glm5-core
    must treat it as opaque). The order of a source's tokens inside an (expert, source rank) block is NOT
    documented: ``block_order`` "token" (ascending) or "reversed" (adversarial).
  * combine: expand_x must be [A, H] as dispatch returned it; each token gets back its K rows "along the path"
    and x[t] = Sum_k expert_scales[t, k] * row(t, k), here in fp32 in slot order (the documents state neither),
    in expand_x's dtype.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

HALF = (torch.float16, torch.bfloat16)
LIMITS = {"A2": dict(max_h=7168, max_bs=256), "A3": dict(h=7168, max_bs=512)}


class VendorContractError(AssertionError):
    """The backend called a vendor op outside its documented contract."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise VendorContractError(message)


class DistributeWorld:
    """The shared state of ``world`` simulated ranks; ``ops(rank)`` is rank ``rank``'s torch_npu stand-in."""

    def __init__(self, world: int, soc: str = "A2", block_order: str = "token", timeout: float = 30.0):
        require(block_order in ("token", "reversed"), f"block_order {block_order!r}")
        self.world, self.soc, self.block_order = world, soc, block_order
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.sent: list[Optional[tuple]] = [None] * world
        self.returned: list[Optional[torch.Tensor]] = [None] * world
        self.routes: list[Optional[list]] = [None] * world  # per rank: (source rank, token, slot) of each row

    def ops(self, rank: int) -> RankOps:
        return RankOps(self, rank)


class RankOps:
    def __init__(self, world: DistributeWorld, rank: int):
        self.w, self.rank = world, rank

    def _check_common(self, x_shape, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                      shared_expert_rank_num, global_bs):
        w = self.w
        require(isinstance(group_ep, str) and 1 <= len(group_ep) < 128, f"group_ep {group_ep!r}")
        require(ep_world_size == w.world and ep_rank_id == self.rank,
                f"ep_world_size/ep_rank_id {ep_world_size}/{ep_rank_id}, expected {w.world}/{self.rank}")
        require(shared_expert_rank_num == 0, "emulated without shared-expert ranks")
        require(moe_expert_num % ep_world_size == 0, "moe_expert_num must be a multiple of ep_world_size")
        BS, H = x_shape
        require(expert_ids.dtype == torch.int32 and tuple(expert_ids.shape[:1]) == (BS,) and expert_ids.dim() == 2,
                f"expert_ids must be int32 [BS, K], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
        K = expert_ids.shape[1]
        require(0 < K <= 8 and K <= moe_expert_num, f"K={K}")
        lim = LIMITS[w.soc]
        if w.soc == "A2":
            require(0 < H <= lim["max_h"] and H % 32 == 0, f"A2 H={H}")
        else:
            require(H == lim["h"], f"A3 H={H}")
        require(0 < BS <= lim["max_bs"], f"{w.soc} BS={BS}")
        ids = expert_ids.long()
        require(bool(((ids >= 0) & (ids < moe_expert_num)).all()), "expert_ids outside [0, moe_expert_num)")
        require(bool((torch.sort(ids, 1).values.diff(dim=1) != 0).all()) if K > 1 else True,
                "the K experts of a row must be distinct")
        return BS, H, K

    def npu_moe_distribute_dispatch_v2(self, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                       scales=None, x_active_mask=None, expert_scales=None, group_tp="",
                                       tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
                                       shared_expert_rank_num=0, quant_mode=0, global_bs=0,
                                       expert_token_nums_type=1, comm_alg=""):
        w, r = self.w, self.rank
        require(x.dim() == 2 and x.dtype in HALF, f"x must be fp16/bf16 [BS, H], got {x.dtype} {tuple(x.shape)}")
        BS, H, K = self._check_common(x.shape, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                                      shared_expert_rank_num, global_bs)
        require(quant_mode == 0 and scales is None, "emulated without quantisation (quant_mode 0, no scales)")
        require(group_tp == "" and tp_world_size in (0, 1), "emulated without a TP domain")
        require(expert_token_nums_type in (0, 1), f"expert_token_nums_type {expert_token_nums_type}")
        w.sent[r] = (x.clone(), expert_ids.long().clone(), global_bs)
        w.barrier.wait()  # the exchange
        sizes = [s[0].shape[0] for s in w.sent]
        require(len({s[2] for s in w.sent}) == 1, "global_bs must be equal on every rank")
        if global_bs == 0:
            require(len(set(sizes)) == 1, "global_bs 0 needs the same BS on every rank")
            A_tokens = BS * w.world
        else:
            require(global_bs == max(sizes) * w.world, f"global_bs {global_bs} != max BS * ep_world_size")
            A_tokens = global_bs
        Lx = moe_expert_num // w.world
        A = A_tokens * min(Lx, K)
        rows, route, counts = [], [], []
        for e in range(r * Lx, (r + 1) * Lx):
            n = 0
            for src in range(w.world):
                xs, ids, _ = w.sent[src]
                block = [(t, int((ids[t] == e).nonzero()[0, 0])) for t in range(xs.shape[0])
                         if bool((ids[t] == e).any())]
                if w.block_order == "reversed":
                    block = block[::-1]
                for t, j in block:
                    rows.append(xs[t])
                    route.append((src, t, j))
                n += len(block)
            counts.append(n)
        expand_x = torch.full((A, H), float("nan"), dtype=x.dtype)
        if rows:
            expand_x[:len(rows)] = torch.stack(rows)
        assist = torch.full((A * 128,), -1, dtype=torch.int32)
        for i, (src, t, j) in enumerate(route):
            assist[i * 128:i * 128 + 3] = torch.tensor([src, t, j], dtype=torch.int32)
        w.routes[r] = route
        tokens = torch.tensor(counts, dtype=torch.int64)
        if expert_token_nums_type == 0:
            tokens = tokens.cumsum(0)
        recv = torch.tensor(counts, dtype=torch.int32)  # opaque to the caller: passed back to combine
        w.barrier.wait()  # every rank has read what was sent
        return expand_x, torch.empty(0), assist, tokens, recv, torch.empty(0, dtype=torch.int32), torch.empty(0)

    def npu_moe_distribute_combine_v2(self, expand_x, expert_ids, assist_info_for_combine, ep_send_counts,
                                      expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                      tp_send_counts=None, x_active_mask=None, expand_scales=None,
                                      shared_expert_x=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                      expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                      global_bs=0, comm_quant_mode=0, comm_alg=""):
        w, r = self.w, self.rank
        xs, ids, sent_global_bs = w.sent[r]
        BS, H, K = self._check_common(xs.shape, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                                      shared_expert_rank_num, global_bs)
        require(global_bs == sent_global_bs, "global_bs must match dispatch's")
        require(torch.equal(expert_ids.long(), ids), "expert_ids must be dispatch's")
        require(expand_x.dtype in HALF and expand_x.dim() == 2 and expand_x.shape[1] == H,
                f"expand_x must be fp16/bf16 [A, {H}], got {expand_x.dtype} {tuple(expand_x.shape)}")
        require(assist_info_for_combine.dtype == torch.int32 and
                assist_info_for_combine.numel() == expand_x.shape[0] * 128,
                "expand_x must keep dispatch's A rows ([A, H], assist_info [A * 128])")
        require(expert_scales is not None and expert_scales.dtype == torch.float32 and
                tuple(expert_scales.shape) == (BS, K), "expert_scales must be fp32 [BS, K]")
        w.returned[r] = expand_x.clone()
        w.barrier.wait()
        gathered = {}
        for dst in range(w.world):
            for i, (src, t, j) in enumerate(w.routes[dst]):
                if src == r:
                    gathered[(t, j)] = w.returned[dst][i].float()
        out = torch.zeros(BS, H, dtype=torch.float32)
        for t in range(BS):
            for j in range(K):  # slot order, fp32 (the documents state neither)
                out[t] = out[t] + expert_scales[t, j] * gathered[(t, j)]
        w.barrier.wait()
        return out.to(expand_x.dtype)
