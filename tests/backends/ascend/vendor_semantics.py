"""Executable statements of the documented semantics of the torch_npu operators the ascend backend calls.

``AscendSemantics`` stands in for the ``torch_npu`` namespace (pass it as ``npu=`` to a kernel). Each method
checks the argument contract its documentation states (layouts, shapes, dtypes, int32 lengths, prefix sums,
head counts, modes) and raises ``VendorContractError`` when it is broken, then computes what the
documentation's formula says, in fp32, with plain per-row loops: written for clarity and independently of
``backends/ascend/*_layouts.py``, so a wrong layout or an off-by-one in the backend fails here.

Where the documentation leaves an order open (ties in a top-k, stability of a key-value sort) the emulator
takes the order given by ``tie_order``: ``"high_first"`` (adversarial: equal keys come out highest index
first) or ``"low_first"``. The backend must produce our contract under both.

Sources (Ascend ``op-plugin/docs/context/``): torch_npu-npu_lightning_indexer.md,
torch_npu-npu_sparse_flash_attention.md, torch_npu-npu_fused_infer_attention_score.md,
torch_npu-npu_moe_gating_top_k.md, torch_npu-npu_moe_init_routing_v2.md, torch_npu-npu_grouped_matmul.md,
torch_npu-npu_moe_finalize_routing.md; formulas also in CANN ops-transformer ``moe/*/docs/aclnn*.md``.
"""
from __future__ import annotations

from typing import Optional

import torch

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
NEG_INF = float("-inf")


class VendorContractError(AssertionError):
    """The backend called a vendor op outside its documented contract."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise VendorContractError(message)


def _prefix_sums_ok(name: str, sums: Optional[torch.Tensor], total: int) -> list[int]:
    require(sums is not None, f"{name}: required for TND layouts")
    require(sums.dtype == torch.int32 and sums.dim() == 1,
            f"{name}: expected 1-D int32, got {sums.dtype} {tuple(sums.shape)}")
    values = sums.tolist()
    require(all(b >= a for a, b in zip([0] + values, values)), f"{name}: prefix sums must not decrease, got {values}")
    require(values[-1] == total, f"{name}: last prefix sum {values[-1]} != {total} packed tokens")
    return [b - a for a, b in zip([0] + values[:-1], values)]


def _lengths_ok(name: str, lengths: Optional[torch.Tensor], batch: int, bound: int) -> list[int]:
    if lengths is None:
        return [bound] * batch
    require(lengths.dtype == torch.int32 and tuple(lengths.shape) == (batch,),
            f"{name}: expected int32 [{batch}], got {lengths.dtype} {tuple(lengths.shape)}")
    values = lengths.tolist()
    require(all(0 <= v <= bound for v in values), f"{name}: lengths {values} outside [0, {bound}]")
    return values


def _ordered_desc(scores: torch.Tensor, tie_order: str) -> torch.Tensor:
    """Indices sorting a 1-D score vector descending; equal scores in the emulator's tie order."""
    n = scores.shape[0]
    if tie_order == "low_first":
        return torch.sort(scores, descending=True, stable=True).indices
    flipped = torch.arange(n - 1, -1, -1)
    return flipped[torch.sort(scores[flipped], descending=True, stable=True).indices]


class AscendSemantics:
    def __init__(self, tie_order: str = "high_first"):
        require(tie_order in ("high_first", "low_first"), f"tie_order {tie_order!r}")
        self.tie_order = tie_order
        self.calls: list[str] = []

    # -------------------------------------------------------------------------------- lightning indexer
    def npu_lightning_indexer(self, query, key, weights, *, actual_seq_lengths_query=None,
                              actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                              layout_key="BSND", sparse_count=2048, sparse_mode=3,
                              pre_tokens=2 ** 63 - 1, next_tokens=2 ** 63 - 1, return_value=False):
        self.calls.append("npu_lightning_indexer")
        require(layout_query in ("BSND", "TND"), f"layout_query {layout_query!r}")
        require(block_table is None and layout_key == layout_query,
                "without PageAttention layout_key must equal layout_query")
        for name, t in (("query", query), ("key", key), ("weights", weights)):
            require(t.is_contiguous(), f"{name} must be contiguous")
            require(t.dtype in HALF, f"{name} dtype {t.dtype} not fp16/bf16")
        require(key.dtype == query.dtype and weights.dtype == query.dtype, "query, key, weights must share a dtype")
        require(1 <= sparse_count <= 2048, f"sparse_count {sparse_count} outside [1, 2048]")
        require(sparse_mode in (0, 3), f"sparse_mode {sparse_mode}")
        if layout_query == "BSND":
            require(query.dim() == 4 and key.dim() == 4 and weights.dim() == 3, "BSND ranks: query 4, key 4, weights 3")
            B, S1, N1, D = query.shape
            S2 = key.shape[1]
            require(key.shape[0] == B and tuple(weights.shape) == (B, S1, N1), "BSND batch / weights shape mismatch")
            q_lens = _lengths_ok("actual_seq_lengths_query", actual_seq_lengths_query, B, S1)
            k_lens = _lengths_ok("actual_seq_lengths_key", actual_seq_lengths_key, B, S2)
            rows = [(query[b, :q_lens[b]], key[b, :k_lens[b], 0], weights[b, :q_lens[b]]) for b in range(B)]
        else:
            require(query.dim() == 3 and key.dim() == 3 and weights.dim() == 2, "TND ranks: query 3, key 3, weights 2")
            N1, D = query.shape[1], query.shape[2]
            require(weights.shape == query.shape[:2], "TND weights must be [T1, N1]")
            q_lens = _prefix_sums_ok("actual_seq_lengths_query", actual_seq_lengths_query, query.shape[0])
            k_lens = _prefix_sums_ok("actual_seq_lengths_key", actual_seq_lengths_key, key.shape[0])
            require(len(q_lens) == len(k_lens), "query and key prefix sums must give the same batch")
            q_starts = torch.tensor([0] + q_lens).cumsum(0).tolist()
            k_starts = torch.tensor([0] + k_lens).cumsum(0).tolist()
            rows = [(query[q_starts[b]:q_starts[b + 1]], key[k_starts[b]:k_starts[b + 1], 0],
                     weights[q_starts[b]:q_starts[b + 1]]) for b in range(len(q_lens))]
        require(N1 == 64, f"query heads N1 must be 64, got {N1}")
        require(key.shape[-2] == 1, f"key heads N2 must be 1, got {key.shape[-2]}")
        require(D == 128 and key.shape[-1] == 128, f"head dim must be 128, got query {D}, key {key.shape[-1]}")
        outputs = [self._indexer_row(q, k, w, sparse_count, sparse_mode) for q, k, w in rows]
        if layout_query == "BSND":
            indices = torch.full((query.shape[0], query.shape[1], 1, sparse_count), -1, dtype=torch.int32)
            for b, out in enumerate(outputs):
                indices[b, :out.shape[0], 0] = out
        else:
            indices = torch.cat(outputs).unsqueeze(1) if outputs else torch.empty(0, 1, sparse_count, dtype=torch.int32)
        return indices, torch.zeros(indices.shape, dtype=query.dtype)

    def _indexer_row(self, q, k, w, sparse_count, sparse_mode):
        s1, s2 = q.shape[0], k.shape[0]
        dots = torch.einsum("ihd,jd->ihj", q.float(), k.float())  # [s1, N1, s2]
        scores = (w.float().unsqueeze(-1) * torch.relu(dots)).sum(1)  # [s1, s2]
        out = torch.full((s1, sparse_count), -1, dtype=torch.int32)
        for i in range(s1):
            visible = s2 - s1 + i + 1 if sparse_mode == 3 else s2  # bottom-right causal
            if visible <= 0:
                continue
            order = _ordered_desc(scores[i, :visible], self.tie_order)[:sparse_count]
            out[i, :order.numel()] = order.to(torch.int32)
        return out

    # --------------------------------------------------------------------------- sparse flash attention
    def npu_sparse_flash_attention(self, query, key, value, sparse_indices, scale_value, *, block_table=None,
                                   actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                   key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                   sparse_mode=3, pre_tokens=2 ** 63 - 1, next_tokens=2 ** 63 - 1,
                                   attention_mode=0, return_softmax_lse=False):
        self.calls.append("npu_sparse_flash_attention")
        require(attention_mode == 2, f"attention_mode must be 2 (MLA absorbed), got {attention_mode}")
        require(layout_query == "BSND" and layout_kv == "BSND" and block_table is None,
                "emulated for BSND query and key without PageAttention")
        require(sparse_block_size == 1, "emulated for token-wise sparsity (sparse_block_size 1)")
        require(query_rope is not None and key_rope is not None, "MLA needs query_rope and key_rope")
        for name, t in (("query", query), ("key", key), ("value", value), ("sparse_indices", sparse_indices),
                        ("query_rope", query_rope), ("key_rope", key_rope)):
            require(t.is_contiguous(), f"{name} must be contiguous")
        require(query.dtype in HALF and all(t.dtype == query.dtype for t in (key, value, query_rope, key_rope)),
                "query, key, value, ropes must share an fp16/bf16 dtype")
        B, S1, N1, D = query.shape
        require(D == 512 and key.shape[-1] == 512, f"latent D must be 512, got {D}, {key.shape[-1]}")
        require(N1 in (1, 2, 4, 8, 16, 32, 64, 128), f"N1 {N1}")
        require(key.dim() == 4 and key.shape[0] == B and key.shape[2] == 1,
                f"key must be [B, S2, 1, 512], got {tuple(key.shape)}")
        require(value.shape == key.shape and torch.equal(value, key), "attention_mode 2: value shares key's data")
        S2 = key.shape[1]
        require(tuple(query_rope.shape) == (B, S1, N1, 64) and tuple(key_rope.shape) == (B, S2, 1, 64), "rope shapes")
        require(sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 4 and
                tuple(sparse_indices.shape[:3]) == (B, S1, 1) and sparse_indices.shape[3] > 0,
                f"sparse_indices must be int32 [B, S1, 1, K>0], "
                f"got {sparse_indices.dtype} {tuple(sparse_indices.shape)}")
        require(sparse_mode in (0, 3), f"sparse_mode {sparse_mode}")
        kv_lens = _lengths_ok("actual_seq_lengths_kv", actual_seq_lengths_kv, B, S2)
        out = torch.empty(B, S1, N1, D, dtype=torch.float32)
        for b in range(B):
            for t in range(S1):
                row = sparse_indices[b, t, 0].long()
                valid = row >= 0
                n = int(valid.sum())
                require(bool(valid[:n].all()), f"row ({b},{t}): valid indices must come before -1 entries")
                sel = row[:n]
                require(bool((sel < kv_lens[b]).all()), f"row ({b},{t}): index beyond actual_seq_lengths_kv")
                if sparse_mode == 3:
                    sel = sel[sel <= kv_lens[b] - S1 + t]
                if sel.numel() == 0:  # undocumented: make it loud
                    out[b, t] = float("nan")
                    continue
                k_sel, r_sel = key[b, sel, 0].float(), key_rope[b, sel, 0].float()  # [n, 512], [n, 64]
                scores = (query[b, t].float() @ k_sel.T + query_rope[b, t].float() @ r_sel.T) * scale_value
                out[b, t] = torch.softmax(scores, dim=-1) @ value[b, sel, 0].float()
        empty = torch.empty(0)
        return out.to(query.dtype), empty, empty

    # ------------------------------------------------------------------------ fused infer attention (MLA)
    def npu_fused_infer_attention_score(self, query, key, value, *, query_rope=None, key_rope=None, atten_mask=None,
                                        actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None,
                                        block_size=0, num_heads=1, num_key_value_heads=0, input_layout="BSH",
                                        scale=1.0, sparse_mode=0, **unused):
        self.calls.append("npu_fused_infer_attention_score")
        require(all(v in (None, 0, False) for v in unused.values()), f"unemulated options {sorted(unused)}")
        require(query_rope is not None and key_rope is not None, "emulated for the MLA case (ropes given)")
        require(input_layout == "BSND", "emulated for BSND queries")
        require(query.dim() == 4 and query.dtype in HALF, "query must be fp16/bf16 [B, S, N, D]")
        B, S, N, D = query.shape
        require(D == 512, f"MLA query D must be 512 here, got {D}")
        require(N == num_heads and N in (32, 64, 128), f"num_heads {num_heads} / query N {N} (32, 64, 128)")
        require(1 <= S <= 16, f"MLA query S must be 1..16, got {S}")
        require(num_key_value_heads == 1, f"MLA key heads must be 1, got {num_key_value_heads}")
        require(block_table is not None and block_size in (16, 128),
                "MLA with D=512 requires PageAttention (block 16/128)")
        require(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == B,
                "block_table int32 [B, NB]")
        require(key.dim() == 3 and key.shape[1] == block_size and key.shape[2] == 512,
                f"paged key for BSND queries must be [blocks, block_size, 512], got {tuple(key.shape)}")
        require(value.shape == key.shape and torch.equal(value, key), "MLA value is the latent key cache")
        require(tuple(key_rope.shape) == (key.shape[0], block_size, 64), "key_rope must be [blocks, block_size, 64]")
        require(tuple(query_rope.shape) == (B, S, N, 64), "query_rope shape")
        require(all(t.dtype == query.dtype for t in (key, value, query_rope, key_rope)), "one dtype for all inputs")
        if S == 1:
            require(sparse_mode == 0 and atten_mask is None, "S=1 MLA: sparse_mode 0 without mask")
        else:
            require(sparse_mode == 3 and atten_mask is not None, "S>1 MLA: sparse_mode 3 with the compressed mask")
            require(tuple(atten_mask.shape) == (2048, 2048) and atten_mask.dtype == torch.bool,
                    "compressed mask must be bool [2048, 2048]")
            require(bool(atten_mask[0, 1]) and not bool(atten_mask[1, 0]) and not bool(atten_mask[5, 5]),
                    "compressed mask marks the strict upper triangle")
        require(actual_seq_lengths_kv is not None and len(actual_seq_lengths_kv) >= B, "actual_seq_lengths_kv required")
        q_lens = list(actual_seq_lengths) if actual_seq_lengths is not None else [S] * B
        out = torch.zeros(B, S, N, D, dtype=torch.float32)
        for b in range(B):
            kv_len = int(actual_seq_lengths_kv[b])
            blocks = block_table[b].tolist()
            require(kv_len <= len(blocks) * block_size, f"row {b}: kv length {kv_len} beyond its blocks")
            latent = torch.cat([key[i] for i in blocks])[:kv_len].float()  # [L, 512]
            rope = torch.cat([key_rope[i] for i in blocks])[:kv_len].float()  # [L, 64]
            q_len = int(q_lens[b])
            require(1 <= q_len <= S, f"row {b}: query length {q_len}")
            for t in range(q_len):
                visible = kv_len - q_len + t + 1 if sparse_mode == 3 else kv_len
                scores = (query[b, t].float() @ latent[:visible].T
                          + query_rope[b, t].float() @ rope[:visible].T) * scale
                out[b, t] = torch.softmax(scores, dim=-1) @ latent[:visible]
        return out.to(query.dtype), torch.zeros(1)

    # --------------------------------------------------------------------------------------- MoE gating
    def npu_moe_gating_top_k(self, x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                             norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
        self.calls.append("npu_moe_gating_top_k")
        require(x.dim() == 2 and x.dtype in FLOATS, f"x must be 2-D fp16/bf16/fp32, got {x.dtype} {tuple(x.shape)}")
        N, E = x.shape
        require(E <= 2048, f"at most 2048 experts, got {E}")
        if bias is not None:
            require(bias.dim() == 1 and bias.shape[0] == E and bias.dtype == x.dtype, "bias must be [E] in x's dtype")
        require(group_count > 0 and E % group_count == 0 and E // group_count > 2,
                f"group_count {group_count} for E={E}")
        per_group = E // group_count
        require(-(-per_group // 32) * 32 * group_count <= 2048, "aligned group size times group_count above 2048")
        require(1 <= k_group <= group_count, f"k_group {k_group}")
        require(1 <= k <= per_group * k_group, f"k {k} outside [1, {per_group * k_group}]")
        require(renorm == 0 and norm_type in (0, 1) and group_select_mode in (0, 1),
                "renorm 0, norm_type 0/1, mode 0/1")
        xf = x.float()
        norm = torch.sigmoid(xf) if norm_type == 1 else torch.softmax(xf, dim=-1)  # [N, E]
        select = norm + bias.float() if bias is not None else norm.clone()
        ids = torch.empty(N, k, dtype=torch.int32)
        for n in range(N):
            row = select[n].clone()
            if group_count > 1:
                grouped = row.view(group_count, per_group)
                top2 = torch.sort(grouped, dim=-1, descending=True).values[:, :2].sum(-1)
                group_score = top2 if group_select_mode == 1 else grouped.max(-1).values
                kept = _ordered_desc(group_score, self.tie_order)[:k_group]
                keep = torch.zeros(group_count, dtype=torch.bool)
                keep[kept] = True
                row = torch.where(keep.repeat_interleave(per_group), row, torch.full_like(row, NEG_INF))
            ids[n] = _ordered_desc(row, self.tie_order)[:k].to(torch.int32)
        y = norm.gather(1, ids.long())
        if norm_type == 1 or renorm == 1:
            y = y / (y.sum(-1, keepdim=True) + eps)
        y = y * routed_scaling_factor
        return y.to(x.dtype), ids, (norm if out_flag else None)

    # ------------------------------------------------------------------------------------ init routing v2
    def npu_moe_init_routing_v2(self, x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                                expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                                expert_tokens_num_flag=False, quant_mode=0, active_expert_range=(), row_idx_type=0):
        self.calls.append("npu_moe_init_routing_v2")
        require(x.dim() == 2 and x.dtype in FLOATS, "x must be 2-D float")
        require(expert_idx.dim() == 2 and expert_idx.dtype == torch.int32 and expert_idx.shape[0] == x.shape[0],
                f"expert_idx must be int32 [NUM_ROWS, K], got {expert_idx.dtype} {tuple(expert_idx.shape)}")
        N, K = expert_idx.shape
        require(active_num == N * K, f"active_num must equal NUM_ROWS*K={N * K}, got {active_num}")
        require(expert_capacity >= 0, f"expert_capacity must be >= 0, got {expert_capacity}")
        require(drop_pad_mode == 0 and quant_mode == -1 and scale is None and offset is None,
                "emulated for dropless, unquantised routing")
        require(expert_tokens_num_type in (1, 2) and expert_tokens_num_flag, "counts need type 1/2 and the flag")
        require(list(active_expert_range) == [0, expert_num], f"emulated for the full range [0, {expert_num}]")
        require(row_idx_type in (0, 1), f"row_idx_type {row_idx_type}")
        flat = expert_idx.reshape(-1).long()  # flat i -> token i // K
        require(bool(((flat >= 0) & (flat < expert_num)).all()), "expert ids outside [0, expert_num)")
        rows = torch.arange(flat.numel())
        if self.tie_order == "low_first":
            sorted_row_idx = torch.sort(flat, stable=True).indices
        else:  # key-value sort whose equal keys come out in reverse order
            sorted_row_idx = rows.flip(0)[torch.sort(flat.flip(0), stable=True).indices]
        expanded_x = x[sorted_row_idx // K]
        # row_idx_type 1 ("scatter" index): sorted row i -> the flat assignment it holds (sortedRowIdx itself,
        # written straight to the output by the sort); 0 ("gather" index): the inverse,
        # expandedRowIdx[sortedRowIdx[i]] = i. CANN ops-transformer moe_init_routing_v3 kernels
        # (moe_v3_sort_one_core.h, moe_v3_row_idx_gather.h, moe_v3_gather_out.h), which torch_npu calls.
        if row_idx_type == 1:
            expanded_row_idx = sorted_row_idx.to(torch.int32)
        else:
            expanded_row_idx = torch.empty_like(sorted_row_idx)
            expanded_row_idx[sorted_row_idx] = rows
            expanded_row_idx = expanded_row_idx.to(torch.int32)
        counts = torch.bincount(flat, minlength=expert_num).to(torch.int64)
        if expert_tokens_num_type == 2:
            counts = torch.stack([torch.arange(expert_num), counts], dim=1)
        return expanded_x, expanded_row_idx, counts, torch.empty(N * K, dtype=torch.float32)

    # ------------------------------------------------------------------------------------ grouped matmul
    def npu_grouped_matmul(self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                           activation_quant_scale=None, activation_quant_offset=None, split_item=0,
                           group_type=None, group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
        self.calls.append("npu_grouped_matmul")
        require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), "x and weight are tensor lists")
        require(len(x) == 1 and len(weight) == 1, "emulated for the single-single-single form")
        require(all(v is None for v in (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale)),
                "emulated unquantised, without bias")
        require(group_type == 0 and split_item in (2, 3) and act_type == 0, "single form: group_type 0, split_item 2/3")
        xs, w = x[0], weight[0]
        require(xs.dim() == 2 and w.dim() == 3, f"x 2-D and weight 3-D, got {xs.dim()} and {w.dim()}")
        require(xs.is_contiguous(), "x may not be transposed")
        require(xs.dtype in FLOATS and w.dtype == xs.dtype, f"x / weight dtypes {xs.dtype} / {w.dtype}")
        M, Kin = xs.shape
        E, w_in, w_out = w.shape
        require(w_in == Kin, f"weight [E, in, out] must have in={Kin}, got {tuple(w.shape)}")
        require(E <= 1024 and max(Kin, w_out) < 65536, "at most 1024 groups, inner dims below 65536")
        require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and
                tuple(group_list.shape) == (E,), f"group_list must be int64 [E={E}]")
        values = group_list.tolist()
        if group_list_type == 0:
            require(all(b >= a for a, b in zip([0] + values, values)) and values[-1] == M, "cumulative group_list")
            ends = values
        else:
            require(group_list_type == 1 and E != 1 and sum(values) == M and min(values) >= 0, "count group_list")
            ends = torch.tensor(values).cumsum(0).tolist()
        y = torch.zeros(M, w_out, dtype=torch.float32)
        start = 0
        for e, end in enumerate(ends):
            y[start:end] = xs[start:end].float() @ w[e].float()
            start = end
        return [y.to(output_dtype or xs.dtype)]

    # ---------------------------------------------------------------------------------- finalize routing
    def npu_moe_finalize_routing(self, expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                                 export_for_source_row, drop_pad_mode=0):
        self.calls.append("npu_moe_finalize_routing")
        rows = expanded_permuted_rows
        require(rows.dim() == 2 and rows.dtype in FLOATS, "expanded_permuted_rows must be 2-D float (dropless)")
        require(drop_pad_mode in (0, 2), "emulated for the dropless modes 0 / 2")
        require(skip1 is not None or skip2 is None, "skip2 needs skip1")
        require(scales is not None and scales.dim() == 2 and scales.dtype == rows.dtype,
                f"scales must be [NUM_ROWS, K] in the rows' dtype, got {None if scales is None else scales.dtype}")
        N, K = scales.shape
        idx = expanded_src_to_dst_row
        require(idx.dtype == torch.int32 and tuple(idx.shape) == (N * K,), "expanded_src_to_dst_row int32 [NUM_ROWS*K]")
        require(bool(((idx >= 0) & (idx < N * K)).all()), "expanded_src_to_dst_row outside [0, NUM_ROWS*K-1]")
        require(bias is None or export_for_source_row is not None, "bias needs export_for_source_row")
        out = torch.zeros(N, rows.shape[1], dtype=torch.float32)
        for i in range(N):
            acc = torch.zeros(rows.shape[1])
            for k in range(K):
                flat = i + k * N if drop_pad_mode == 0 else i * K + k
                r = rows[int(idx[flat])].float()
                if bias is not None:
                    r = r + bias[int(export_for_source_row[i, k])].float()
                acc = acc + scales[i, k].float() * r
            out[i] = acc
        for skip in (skip1, skip2):
            if skip is not None:
                out = out + skip.float()
        return out.to(rows.dtype)
