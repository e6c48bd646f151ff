"""A stand-in for ``deep_ep.ElasticBuffer`` (dispatch / combine in expand mode) over ``torch.distributed`` (gloo
here), written from deepseek-ai/DeepEP at commit dd758caf451848bd150e1046af3d0a73e5fff38d (deep_ep 2.1.0), none of
glm5-core's code inside:

  * ``deep_ep/utils/refs.py`` ``dispatch``: each token goes once to every rank holding one of its experts, with
    ``src_token_global_idx = src_rank_idx * num_max_tokens_per_rank + src_token_local_idx`` and its top-k ids
    masked to that rank's experts (-1 elsewhere); received rank-major. The real kernel's arrival order is not
    rank-major: ``arrival="reversed"`` models another order (last rank first, tokens reversed);
  * ``deep_ep/buffers/elastic.py`` ``ElasticBuffer.dispatch(do_expand=True)``: one row per (token, local expert)
    grouped by local expert, each expert's block padded to ``expert_alignment`` (zeros), ``EPHandle`` with
    ``psum_num_recv_tokens_per_expert[i]`` = aligned rows before expert i + its real count,
    ``num_unaligned_recv_tokens_per_expert``, ``num_recv_tokens_per_expert_list``, ``recv_src_metadata`` [n, 2 + K]
    ([:, 0] the source global index, [:, 2:] each slot's expanded row, -1 none), recv_topk_weights one per
    expanded row; ``deterministic=True`` runs ``EPHandle.deterministic_sort``'s expand branch (rows sorted inside
    each expert by the source global index, padding last, the slot pointers updated);
  * ``combine(x, handle)``: x [expanded rows, H] bf16, ALREADY weighted by the caller (``combine.cuh`` asserts
    ``topk_weights == nullptr`` for the expanded send); each token's valid slots are reduced at the source
    (``combine_utils.cuh`` ``combine_reduce``): with at most two valid slots and no bias, one bf16 add
    (``enable_hadd_bypass``), else an fp32 sum over the slots in order, rounded to bf16 once. Returns
    (combined_x bf16 [T, H], combined_topk_weights, event).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _Event:
    def current_stream_wait(self) -> None:
        pass


class EPHandle:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _exchange(tensor: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=group)
    return out


class ElasticBuffer:
    def __init__(self, group, num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 deterministic: bool = False, allow_multiple_reduction: bool = True, arrival: str = "rank_major"):
        assert arrival in ("rank_major", "reversed")
        self.group = group
        self.rank_idx, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk
        self.deterministic, self.allow_multiple_reduction, self.arrival = (deterministic, allow_multiple_reduction,
                                                                            arrival)

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, expert_alignment=None,
                 do_expand=False, do_cpu_sync=None, **ignored):
        assert do_expand, "this stand-in states the expanding layout only"
        assert x.dtype == torch.bfloat16, "x must be bf16 (or an fp8 tuple)"
        assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
        num_tokens, num_topk = topk_idx.shape
        assert num_tokens <= self.num_max_tokens_per_rank
        alignment = expert_alignment or 1
        world, rank, group = self.num_ranks, self.rank_idx, self.group
        local = num_experts // world
        # refs.dispatch: per destination, the tokens with an expert there, masked ids, global source index
        send_x, send_idx, send_w, send_src, send_counts = [], [], [], [], []
        for dst in range(world):
            lo, hi = dst * local, (dst + 1) * local
            tokens = ((lo <= topk_idx) & (topk_idx < hi)).any(dim=1).nonzero(as_tuple=True)[0]
            send_counts.append(tokens.numel())
            ids = topk_idx[tokens]
            send_x.append(x[tokens])
            send_idx.append(torch.where((lo <= ids) & (ids < hi), ids, torch.full_like(ids, -1)))
            send_w.append(topk_weights[tokens])
            send_src.append(tokens + rank * self.num_max_tokens_per_rank)
        counts_in = torch.empty(world, dtype=torch.int64)
        dist.all_to_all_single(counts_in, torch.tensor(send_counts, dtype=torch.int64), group=group)
        recv_counts = counts_in.tolist()
        recv_x = _exchange(torch.cat(send_x), send_counts, recv_counts, group)
        recv_idx = _exchange(torch.cat(send_idx), send_counts, recv_counts, group)
        recv_w = _exchange(torch.cat(send_w), send_counts, recv_counts, group)
        recv_src = _exchange(torch.cat(send_src), send_counts, recv_counts, group)
        if self.arrival == "reversed":  # another arrival order than rank-major
            perm = torch.arange(recv_x.shape[0] - 1, -1, -1)
            recv_x, recv_idx, recv_w, recv_src = recv_x[perm], recv_idx[perm], recv_w[perm], recv_src[perm]
        recv_idx = torch.where(recv_idx >= 0, recv_idx - rank * local, recv_idx)
        # expand: one row per (received token, local expert), grouped by expert in arrival order
        n = recv_x.shape[0]
        unaligned = [int((recv_idx == e).sum()) for e in range(local)]
        aligned = [-(-c // alignment) * alignment for c in unaligned]
        starts = [sum(aligned[:e]) for e in range(local)]
        total = sum(aligned)
        expanded = torch.zeros(total, x.shape[1], dtype=x.dtype)
        expanded_w = torch.zeros(total, dtype=torch.float32)
        slots = torch.full((n, num_topk), -1, dtype=torch.int64)
        fill = list(starts)
        for i in range(n):
            for j in range(num_topk):
                e = int(recv_idx[i, j])
                if e >= 0:
                    slots[i, j] = fill[e]
                    expanded[fill[e]] = recv_x[i]
                    expanded_w[fill[e]] = recv_w[i, j]
                    fill[e] += 1
        psum = torch.tensor([starts[e] + unaligned[e] for e in range(local)], dtype=torch.int32)
        metadata = torch.cat([recv_src[:, None], torch.zeros(n, 1, dtype=torch.int64), slots], dim=1).to(torch.int32)
        handle = EPHandle(do_expand=True, num_experts=num_experts, expert_alignment=alignment,
                          num_max_tokens_per_rank=self.num_max_tokens_per_rank, topk_idx=topk_idx.clone(),
                          num_recv_tokens=n, num_expanded_tokens=total, num_recv_tokens_per_expert_list=unaligned,
                          psum_num_recv_tokens_per_expert=psum,
                          num_unaligned_recv_tokens_per_expert=torch.tensor(unaligned, dtype=torch.int32),
                          recv_src_metadata=metadata, recv_counts=recv_counts, send_counts=send_counts)
        if self.deterministic:  # EPHandle.deterministic_sort, expand branch
            big = 10000000000
            start_t = torch.tensor(starts, dtype=torch.int64)
            expert_of = torch.bucketize(torch.arange(total), start_t[1:], right=True)
            keys = expert_of * big
            meta = metadata.to(torch.int64)
            valid = meta[:, 2:] >= 0
            keys.scatter_add_(0, meta[:, 2:][valid],
                              -big // 2 + meta[:, 0].unsqueeze(1).expand_as(meta[:, 2:])[valid])
            orig = torch.sort(keys, stable=True).indices
            expanded, expanded_w = expanded[orig], expanded_w[orig]
            to = torch.empty_like(orig)
            to[orig] = torch.arange(total)
            new_slots = meta[:, 2:].clone()
            new_slots[valid] = to[new_slots[valid]]
            handle.recv_src_metadata = torch.cat([meta[:, :2], new_slots], dim=1).to(torch.int32)
        return expanded, None, expanded_w, handle, _Event()

    def combine(self, x, handle, topk_weights=None, bias=None, **ignored):
        assert x.dtype == torch.bfloat16 and x.shape[0] == handle.num_expanded_tokens
        assert bias is None
        meta = handle.recv_src_metadata.to(torch.int64)
        n, num_topk = meta.shape[0], meta.shape[1] - 2
        slots = meta[:, 2:]
        # back to the sources: per received token its K slot rows (zeros where none), in the order received
        back = torch.zeros(n, num_topk, x.shape[1], dtype=torch.bfloat16)
        valid = slots >= 0
        back[valid] = x[slots[valid]]
        src = meta[:, 0]
        # the arrival order may differ from rank-major: send to each source its tokens
        ranks = src // self.num_max_tokens_per_rank
        order = torch.sort(ranks, stable=True).indices
        send_counts = [int((ranks == r).sum()) for r in range(self.num_ranks)]
        counts_in = torch.empty(self.num_ranks, dtype=torch.int64)
        dist.all_to_all_single(counts_in, torch.tensor(send_counts, dtype=torch.int64), group=self.group)
        recv_counts = counts_in.tolist()
        got = _exchange(back[order], send_counts, recv_counts, self.group)
        got_valid = _exchange(valid[order].to(torch.int64), send_counts, recv_counts, self.group).bool()
        got_local = _exchange(src[order] % self.num_max_tokens_per_rank, send_counts, recv_counts, self.group)
        num_tokens = handle.topk_idx.shape[0]
        # per token, the valid slot rows in slot order (a token's rows from several ranks hold disjoint slots)
        rows = torch.zeros(num_tokens, num_topk, x.shape[1], dtype=torch.bfloat16)
        has = torch.zeros(num_tokens, num_topk, dtype=torch.bool)
        for i in range(got.shape[0]):
            t = int(got_local[i])
            rows[t][got_valid[i]] = got[i][got_valid[i]]
            has[t] |= got_valid[i]
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.bfloat16)
        for t in range(num_tokens):
            chosen = [rows[t, j] for j in range(num_topk) if bool(has[t, j])]
            if len(chosen) <= 2:  # enable_hadd_bypass: bf16 add of at most two rows
                acc = chosen[0] if chosen else torch.zeros(x.shape[1], dtype=torch.bfloat16)
                out[t] = acc + chosen[1] if len(chosen) == 2 else acc
            else:
                acc = torch.zeros(x.shape[1], dtype=torch.float32)
                for row in chosen:
                    acc += row.float()
                out[t] = acc.to(torch.bfloat16)
        return out, None, _Event()
