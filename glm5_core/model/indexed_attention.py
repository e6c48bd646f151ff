"""GLM-5.3's indexed attention: NoPE MLA with the k-pool DSA indexer (transformers 5.25 ``glm5_next``).

Legend: B batch, T new tokens, S key slots, H heads, Hi index_n_heads, Di index_head_dim, P index_kpool,
G = S // P complete groups, K index_topk, D hidden_size, Q q_lora_rank.

The MLA part is GLM-5's (``attention.MLA``) with ``qk_rope_head_dim = 0``: no RoPE anywhere, the latent cache
holds ``c_kv`` only. The indexer (:class:`KPoolIndexer`, transformers' ``Glm5NextTextIndexer`` parameters and
names) scores POOLED keys:

  q = wq_b(q_latent) [B, T, Hi, Di];  k = k_norm(wk(x)) [B, S, Di];  gate = x @ index_kpool_compress_gate^T [B, S, Di]
  group g holds keys g P .. g P + P - 1; its pooled key is sum_j softmax_j(gate_j + ape_j) * k_j (per channel)
  score(t, g) = sum_h w[t, h] relu(q[t, h] . pooled_g * Di^-0.5),  w = weights_proj(x) * Hi^-0.5
  a group is selectable by query t when its last key is causal for t; the top K / P groups are kept and
  expanded to their P keys each; with ``index_kpool_always_select_tail`` the keys of t's own incomplete group
  (up to P - 1 of them) are appended. Width K (+ P - 1 with the tail), ``-1`` padding, int32.

A "shared" layer reuses the top-k of the indexed "full" layer just before it (transformers passes the previous
layer's selection only). The top-k itself is the op ``dsa.kpool_topk``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from glm5_core import registry
from glm5_core.model import indexer_loss
from glm5_core.model.attention import MLA
from glm5_core.model.config import GLM5Config
from glm5_core.model.state import ForwardState
from glm5_core.ops import dsa


class KPoolIndexer(nn.Module):
    """The k-pool lightning indexer's parameters (transformers' names) and its projections."""

    def __init__(self, cfg: GLM5Config):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.kpool = cfg.index_kpool
        self.select_tail = cfg.index_kpool_always_select_tail
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.ones(self.head_dim, cfg.hidden_size))

    @property
    def width(self) -> int:
        """Entries per query of the top-k it returns."""
        return self.topk + (self.kpool - 1 if self.select_tail else 0)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D], q_latent [B, T, Q] -> q [B, T, Hi, Di], k [B, T, Di], gate [B, T, Di], w [B, T, Hi]."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)) * self.n_heads ** -0.5
        return q, k, gate, w


def kpool_select(indexer: KPoolIndexer, q: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor,
                 w: torch.Tensor, start_pos, backend: registry.BackendArg) -> torch.Tensor:
    """The k-pool top-k int32 [B, T, width] of queries at ``start_pos`` over ``keys`` / ``gates`` [B, S, Di]
    (the op ``dsa.kpool_topk``: ties to the lower group)."""
    return dsa.kpool_topk(q, keys, w, gates, indexer.index_kpool_compress_ape, topk=indexer.topk,
                          kpool=indexer.kpool, select_tail=indexer.select_tail, start_pos=start_pos, backend=backend)


def pooled_index_scores(q, keys, gates, w, ape, *, kpool: int, start_pos) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, T, G] over the complete groups, -inf where a group's last key is not causal for the query;
    visible bool [B, T, G]), in fp32 (fp64 for fp64 inputs), differentiable in q, keys, gates, w and ape: what
    the indexer's KL trains (the top-k itself is ``dsa.kpool_topk``)."""
    B, T, Hi, Di = q.shape
    G = keys.shape[1] // kpool
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    pos = start_pos if isinstance(start_pos, torch.Tensor) else torch.full((B,), int(start_pos), device=q.device)
    positions = pos.to(q.device).long().view(B, 1) + torch.arange(T, device=q.device).view(1, T)  # [B, T]
    grouped_k = keys[:, :G * kpool].reshape(B, G, kpool, Di)
    logits = gates[:, :G * kpool].reshape(B, G, kpool, Di).to(ct) + ape.to(ct)
    probs = torch.softmax(logits, dim=2).to(grouped_k.dtype)
    pooled = (probs * grouped_k).sum(dim=2)  # [B, G, Di]
    scores = F.relu(torch.einsum("bthd,bgd->bthg", q.to(ct), pooled.to(ct)) * Di ** -0.5)
    index = torch.einsum("bth,bthg->btg", w.to(ct), scores)  # [B, T, G]
    group_end = (torch.arange(G, device=q.device) + 1) * kpool - 1  # [G]
    visible = group_end.view(1, 1, G) <= positions.unsqueeze(-1)  # [B, T, G]
    return index.masked_fill(~visible, float("-inf")), visible


class IndexedMLA(MLA):
    """NoPE MLA whose "full" layers run the k-pool indexer (GLM-5.3's ``indexed_attention`` layers)."""

    def __init__(self, cfg: GLM5Config, layer_idx: int, indexer_type: str, backend: registry.BackendArg):
        super().__init__(cfg, layer_idx, "shared", backend)  # no GLM-5 indexer: the k-pool one instead
        self.indexer = KPoolIndexer(cfg) if indexer_type == "full" else None
        full = cfg.full_indexer_layers()
        self.full_index = full.index(layer_idx) if layer_idx in full else None

    def _select_keys(self, x: torch.Tensor, q_latent: torch.Tensor, state: ForwardState
                     ) -> tuple[Optional[torch.Tensor], None]:
        if self.indexer is None:
            if state.attention == "sparse":
                if state.shared_topk is None:
                    raise ValueError("indexer_types: a 'shared' indexed layer needs the top-k of the indexed "
                                     "'full' layer just before it")
                return state.shared_topk, None
            return None, None
        if not (state.attention == "sparse" or state.indexer_loss or state.cache is not None):
            return None, None
        q_i, k_i, g_i, w_i = self.indexer(x.detach(), q_latent.detach())
        keys_i, gates_i = k_i, g_i
        if state.cache is not None:
            keys_i, gates_i = state.cache.write_pool_keys(self.layer_idx, k_i, g_i, state.start_pos)
            if state.fresh:
                keys_i, gates_i = k_i, g_i
        index_start = 0 if state.fresh else state.start_pos
        index_inputs = (q_i, keys_i, gates_i, w_i, index_start) if state.indexer_loss else None
        if state.attention != "sparse":
            return None, index_inputs
        topk_idx = kpool_select(self.indexer, q_i, keys_i, gates_i, w_i, index_start, self.kernels)
        if state.record_topk:
            if state.index_replay is not None:
                replay = state.index_replay[self.full_index]
                topk_idx = torch.where(replay[..., :1] >= 0, replay.to(topk_idx.dtype), topk_idx)
            state.topk_idx.append(topk_idx)
            if state.cache is not None and state.cache.index_topk:
                state.cache.write_index_topk(self.layer_idx, topk_idx, state.start_pos)
        state.shared_topk = topk_idx
        return topk_idx, index_inputs

    def _indexer_signals(self, q_nope, q_pe, c_kv, k_pe, w_uk, attn_start, topk_idx, index_inputs, state,
                         k_nope=None) -> None:
        """The k-pool indexer's KL (both stages): KL(p_G || softmax(I_G)) over each query's complete causal groups,
        p_G the main attention's head-summed, L1-normalised probabilities (``indexer_loss.attention_target``)
        summed over each group and renormalised over those groups; queries with no complete group add 0. The
        recall (sparse stage) is p's mass on the selected keys, the tail included."""
        q_i, keys_i, gates_i, w_i, index_start = index_inputs
        target = indexer_loss.attention_target(q_nope, q_pe, c_kv, k_pe, w_uk, scale=self.scale,
                                               start_pos=attn_start)  # [B, T, S]
        scores, visible = pooled_index_scores(q_i, keys_i, gates_i, w_i, self.indexer.index_kpool_compress_ape,
                                              kpool=self.indexer.kpool, start_pos=index_start)  # [B, T, G]
        B, T, G = scores.shape
        P = self.indexer.kpool
        groups = target[..., :G * P].reshape(B, T, G, P).sum(-1) * visible  # [B, T, G]
        groups = groups / groups.sum(-1, keepdim=True).clamp_min(torch.finfo(groups.dtype).tiny)
        any_visible = visible.any(-1, keepdim=True)
        scores = torch.where(any_visible, scores, torch.zeros_like(scores))  # rows without a group: finite, kept out
        state.kl_terms.append(indexer_loss.dense_kl(groups, scores) if G else scores.sum() * 0.0)
        if topk_idx is not None and state.measure_recall:
            state.recall_terms.append(indexer_loss.topk_recall(target, topk_idx))
