"""Multi-head latent attention (MLA) with the DSA indexer, built on ``glm5_core.ops``.

Legend: B batch, T new tokens, S key slots, H heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dv v_head_dim, C kv_lora_rank, Q q_lora_rank, D hidden_size, K index_topk.

q:  x -> q_a_proj [Q] -> q_a_layernorm -> q_b_proj [H*(Dn+Dr)] -> (q_nope, RoPE(q_pe))
kv: x -> kv_a_proj_with_mqa [C+Dr] -> (kv_a_layernorm(c_kv), RoPE(k_pe)); k_pe is shared by all heads.
kv_b_proj.weight [H*(Dn+Dv), C] viewed [H, Dn+Dv, C] gives w_uk [H, Dn, C] and w_uv [H, Dv, C].

Which op runs:
  dense,  fresh keys (no cache, or a cache filled from slot 0):  mla.prefill  (expanded form)
  dense,  against earlier cache slots:                           mla.decode   (absorbed form)
  sparse, while torch.onnx exports (no cache): the same function written as exportable torch ops
          (``_sparse_for_export``): indexer scores, ONNX TopK of width K (ties to the lower key index, as
          ``dsa.indexer_topk``'s contract), the selection as a mask, expanded attention over the selected keys.
  sparse: indexer top-k (own "full" indexer, or the previous full layer's for "shared"), then
          without a cache (training): dsa.sparse_prefill_expanded (expanded form) when it costs less (below),
          else dsa.sparse_prefill; with a cache: dsa.sparse_prefill on fresh keys (the absorbed kernel decode
          runs too, so a prefill and the decode steps after it compute queries alike) / dsa.sparse_decode.
Sparse form by cost (``dsa.prefers_expanded``): fewer multiply-adds, expanding the keys included, and at most 4x
  the values read per selected key (H (Dn+Dv) + Dr against C + Dr). The training config passes (528 vs 144),
  GLM-5's heads do not (28736 vs 576). A backend with a native absorbed kernel and none for the expanded form
  (every accelerator vendor's today) keeps the absorbed one.
The kernels are bound when the layer is built (``registry.bind``): a forward does not resolve them again.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from glm5_core import registry
from glm5_core.model import indexer_loss
from glm5_core.model.config import GLM5Config
from glm5_core.model.indexer import Indexer
from glm5_core.model.norm import RMSNorm
from glm5_core.model.rope import apply_rope
from glm5_core.model.state import ForwardState
from glm5_core.ops import dsa, mla

# (q [B, T, Hi, Di], keys [B, S, Di], w [B, T, Hi], start_pos of the first query)
IndexInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Union[int, torch.Tensor]]


class MLA(nn.Module):
    def __init__(self, cfg: GLM5Config, layer_idx: int, indexer_type: str, backend: registry.BackendArg):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernels = registry.bind(backend)  # resolved once, here
        self.n_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleave = cfg.rope_interleave
        H = self.n_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, cfg.latent_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, cfg.hidden_size, bias=False)
        self.indexer = Indexer(cfg) if indexer_type == "full" else None
        # rank of this layer among the main model's full-indexer layers (its row in topk_idx / index replay)
        self.full_index = cfg.layer_indexer_types()[:layer_idx].count("full") if self.indexer is not None else None
        # the expanded sparse form only where the backend has a kernel for it, or has none for the absorbed one
        # either (a backend whose absorbed prefill is native must not trade it for a reference)
        self.expanded_sparse_native = (not self.kernels.resolution("dsa_sparse_prefill_expanded").is_reference
                                       or self.kernels.resolution("dsa_sparse_prefill").is_reference)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj: w_uk [H, Dn, C], w_uv [H, Dv, C]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)  # [H, Dn+Dv, C]
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        B, T, _ = x.shape
        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, T, Q]
        q = self.q_b_proj(q_latent).view(B, T, self.n_heads, self.nope_dim + self.rope_dim)  # [B, T, H, Dn+Dr]
        q_nope, q_pe = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, state.cos, state.sin, interleave=self.interleave)
        c_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [B, T, C]
        k_pe = apply_rope(k_pe, state.cos, state.sin, interleave=self.interleave)  # [B, T, Dr]
        w_uk, w_uv = self.absorbed_weights()
        if state.attention == "sparse" and state.cache is None and torch.onnx.is_in_onnx_export():
            out = self._sparse_for_export(x, q_latent, q_nope, q_pe, c_kv, k_pe, state)
            return self.o_proj(out.reshape(B, T, self.n_heads * self.v_dim))

        keys_c_kv, keys_k_pe = c_kv, k_pe  # [B, S, C], [B, S, Dr]
        if state.cache is not None:
            keys_c_kv, keys_k_pe = state.cache.write_latent(self.layer_idx, c_kv, k_pe, state.start_pos)
            if state.fresh:
                keys_c_kv, keys_k_pe = c_kv, k_pe  # identical values; keeps autograd through the prefill
        attn_start = 0 if state.fresh else state.start_pos

        topk_idx, index_inputs = self._select_keys(x, q_latent, state)
        k_nope = None  # per-head keys [B, S, H, Dn], when the expanded sparse form runs
        if state.attention == "sparse" and state.cache is None and self._expanded_is_cheaper(T, keys_c_kv.shape[1],
                                                                                            topk_idx.shape[-1]):
            k_nope, v = self._expand_keys(keys_c_kv)  # in the compute dtype; the queries and rope keys follow
            ct = k_nope.dtype
            out = dsa.sparse_prefill_expanded(q_nope.to(ct), q_pe.to(ct), k_nope, keys_k_pe.to(ct), v, topk_idx,
                                              scale=self.scale, backend=self.kernels).to(q_nope.dtype)
        elif state.attention == "sparse":
            sparse_op = dsa.sparse_prefill if state.fresh else dsa.sparse_decode
            out = sparse_op(q_nope, q_pe, keys_c_kv, keys_k_pe, w_uk, w_uv, topk_idx, scale=self.scale,
                            backend=self.kernels)
        elif state.fresh:
            out = mla.prefill(q_nope, q_pe, keys_c_kv, keys_k_pe, w_uk, w_uv, scale=self.scale, start_pos=0,
                              backend=self.kernels)
        else:
            out = mla.decode(q_nope, q_pe, keys_c_kv, keys_k_pe, w_uk, w_uv, scale=self.scale,
                             start_pos=attn_start, backend=self.kernels)
        if state.indexer_loss and index_inputs is not None:
            self._indexer_signals(q_nope, q_pe, keys_c_kv, keys_k_pe, w_uk, attn_start, topk_idx, index_inputs, state,
                                  k_nope=k_nope)
        return self.o_proj(out.reshape(B, T, self.n_heads * self.v_dim))  # [B, T, D]

    def _expanded_is_cheaper(self, queries: int, keys: int, topk: int) -> bool:
        """``dsa.prefers_expanded`` for this layer's sizes, on a backend where the expanded form is not a reference
        standing in for a native absorbed kernel."""
        return self.expanded_sparse_native and dsa.prefers_expanded(
            heads=self.n_heads, nope_dim=self.nope_dim, rope_dim=self.rope_dim, v_dim=self.v_dim,
            kv_rank=self.kv_rank, queries=queries, keys=keys, topk=topk)

    def _expand_keys(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj over the latent rows, once: views k_nope [B, S, H, Dn] and v [B, S, H, Dv] of one tensor, in the
        compute dtype (fp32 for bf16 / fp16 layers: the absorbed form also applies w_uk / w_uv in fp32, and a bf16
        rounding of the expanded keys doubles the bf16 model's error against an fp32 run)."""
        B, S, _ = c_kv.shape
        ct = torch.float32 if c_kv.dtype in (torch.bfloat16, torch.float16) else c_kv.dtype
        kv = nn.functional.linear(c_kv.to(ct), self.kv_b_proj.weight.to(ct))
        kv = kv.view(B, S, self.n_heads, self.nope_dim + self.v_dim)  # [B, S, H, Dn+Dv]
        k_nope, v = torch.split(kv, [self.nope_dim, self.v_dim], dim=-1)
        return k_nope, v

    def _sparse_for_export(self, x, q_latent, q_nope, q_pe, c_kv, k_pe, state: ForwardState) -> torch.Tensor:
        """DSA prefill (no cache) in ops torch.onnx traces with dynamic batch and length: the function of
        ``dsa.indexer_topk`` + ``dsa.sparse_prefill`` (each query attends to its top ``index_topk`` causal keys by
        indexer score, ties to the lower key index; fewer visible keys than K: all of them). The selection is a
        mask [B, T, S] (attention over a set does not depend on its order); "shared" layers reuse the last full
        layer's. Returns [B, T, H, Dv]."""
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)
        causal = pos.view(1, T) <= pos.view(T, 1)  # [T, S=T]: key s visible to query t (no Trilu: opset < 14 too)
        if self.indexer is None:
            assert state.shared_selection is not None, "a shared layer needs an earlier full layer"
            selected = state.shared_selection
        else:
            q_i, k_i, w_i = self.indexer(x, q_latent, state.cos, state.sin)  # [B, T, Hi, Di], [B, S, Di], [B, T, Hi]
            ct = torch.float64 if q_i.dtype == torch.float64 else torch.float32
            dots = torch.einsum("bthd,bsd->bths", q_i.to(ct), k_i.to(ct))  # [B, T, Hi, S]
            scores = (torch.relu(dots) * w_i.to(ct).unsqueeze(-1)).sum(2)  # [B, T, S]
            scores = scores.masked_fill(~causal, float("-inf"))
            # K columns of -inf appended, so TopK of width K is defined for any length (T < K selects them too)
            pad = torch.full_like(scores[..., :1], float("-inf")).expand(-1, -1, self.indexer.topk)
            idx = torch.topk(torch.cat([scores, pad], dim=-1), self.indexer.topk, dim=-1).indices  # [B, T, K]
            hits = torch.zeros_like(torch.cat([scores, pad], dim=-1), dtype=torch.bool)
            hits = hits.scatter(-1, idx, torch.ones_like(idx, dtype=torch.bool))[..., :T]  # [B, T, S]
            selected = hits & causal  # a -inf pick (fewer visible keys than K) is no key
            state.shared_selection = selected
        k_nope, v = self._expand_keys(c_kv)  # [B, S, H, Dn], [B, S, H, Dv]
        ct = k_nope.dtype
        att = torch.einsum("bthd,bshd->bhts", q_nope.to(ct), k_nope)
        att = (att + torch.einsum("bthr,bsr->bhts", q_pe.to(ct), k_pe.to(ct))) * self.scale  # [B, H, T, S]
        att = torch.softmax(att.masked_fill(~selected.unsqueeze(1), float("-inf")), dim=-1)
        return torch.einsum("bhts,bshv->bthv", att, v).to(q_nope.dtype)  # [B, T, H, Dv]

    # ---- DSA -------------------------------------------------------------------------------------------
    def _select_keys(self, x: torch.Tensor, q_latent: torch.Tensor, state: ForwardState
                     ) -> tuple[Optional[torch.Tensor], Optional[IndexInputs]]:
        """Run (or reuse) the indexer. Returns (top-k int32 [B, T, K] or None when not needed, the indexer's
        (q, keys, w, start) or None when this layer has no indexer or did not run it).

        The indexer reads detached inputs: it learns only from its KL, the model only from the LM loss.
        With a cache, a full layer always stores its indexer keys (so any later step may run sparse)."""
        if self.indexer is None:
            if state.attention == "sparse":
                assert state.shared_topk is not None, "a shared layer needs an earlier full layer"
                return state.shared_topk, None
            return None, None
        if not (state.attention == "sparse" or state.indexer_loss or state.cache is not None):
            return None, None
        q_i, k_i, w_i = self.indexer(x.detach(), q_latent.detach(), state.cos, state.sin)
        if state.cache is not None:
            keys_i = state.cache.write_index_keys(self.layer_idx, k_i, state.start_pos)  # [B, S, Di]
            if state.fresh:
                keys_i = k_i
        else:
            keys_i = k_i
        index_start = 0 if state.fresh else state.start_pos
        index_inputs = (q_i, keys_i, w_i, index_start)
        if state.attention != "sparse" and not state.indexer_loss:
            return None, index_inputs
        topk_idx = dsa.indexer_topk(q_i, keys_i, w_i, self.indexer.topk, start_pos=index_start, backend=self.kernels)
        if state.attention == "sparse" and state.record_topk:
            if state.index_replay is not None:  # index replay: rows holding keys select exactly those keys
                replay = state.index_replay[self.full_index]  # [B, T, K]
                topk_idx = torch.where(replay[..., :1] >= 0, replay.to(topk_idx.dtype), topk_idx)
            state.topk_idx.append(topk_idx)
            if state.cache is not None and state.cache.index_topk:
                state.cache.write_index_topk(self.layer_idx, topk_idx, state.start_pos)
        state.shared_topk = topk_idx
        return topk_idx, index_inputs

    def _indexer_signals(self, q_nope, q_pe, c_kv, k_pe, w_uk, attn_start, topk_idx, index_inputs: IndexInputs,
                         state: ForwardState, k_nope: Optional[torch.Tensor] = None) -> None:
        q_i, keys_i, w_i, index_start = index_inputs
        if state.attention == "sparse":  # only the selected keys matter: nothing [B, T, S] is kept
            def target_at_selected(normaliser: str) -> torch.Tensor:  # [B, T, K]
                return indexer_loss.selected_attention_target(q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx,
                                                              scale=self.scale, start_pos=attn_start, k_nope=k_nope,
                                                              normaliser=normaliser, backend=self.kernels)

            target = target_at_selected(state.indexer_kl_target)
            scores = dsa.selected_index_scores(q_i, keys_i, w_i, topk_idx, backend=self.kernels)  # [B, T, K]
            state.kl_terms.append(indexer_loss.selected_kl(target, scores, topk_idx))
            if state.measure_recall:  # the DENSE target's mass on the selected keys
                dense = target if state.indexer_kl_target == "causal" else target_at_selected("causal")
                state.recall_terms.append(indexer_loss.selected_recall(dense))
            return
        target = indexer_loss.attention_target(q_nope, q_pe, c_kv, k_pe, w_uk, scale=self.scale,
                                               start_pos=attn_start)  # [B, T, S]
        scores = dsa.indexer_scores(q_i, keys_i, w_i, start_pos=index_start, backend=self.kernels)  # [B, T, S]
        state.kl_terms.append(indexer_loss.dense_kl(target, scores))
        state.recall_terms.append(indexer_loss.topk_recall(target, topk_idx))
