"""glm5-core forwards for the modules of transformers' ``GlmMoeDsaForCausalLM`` (bound by ``kernelize``).

Each function replaces one module's ``forward``, reads that module's own parameters (nothing is copied or
re-laid-out, so ``state_dict`` is unchanged) and computes what transformers' forward computes, through
``glm5_core.ops`` entry points dispatched by the registry (``module.glm5_backend``). Read against
transformers' ``models/glm_moe_dsa/modeling_glm_moe_dsa.py`` (5.24).

Legend: B batch, T new tokens, S key slots (cache + new), H heads, Dn / Dr / Dv qk_nope / qk_rope / v head
dims, C kv_lora_rank, Hi index_n_heads, Di index_head_dim, K index_topk, N = B*T tokens, E experts,
F moe_intermediate_size.

Attention (MLA + DSA): projections and RoPE are transformers' (its interleaved-pair rotation, in the output
layout its cache holds); the latent cache is transformers' ``Cache`` (``update`` / ``update_indexer``),
never expanded over the cache: queries past index_topk run sparse MLA of ``glm5_core.ops.dsa`` over the K keys the
indexer selected, in the expanded form in a prefill where ``dsa.prefers_expanded`` (kv_b_proj over the prompt's
rows once: Dn + Dr products per score instead of C + Dr) and in the absorbed form otherwise and against a cache
(decode); a query at a slot below index_topk, for which DSA selects every visible key, needs no indexer scores:
in a prefill it runs dense causal attention in the expanded form (``dense_causal_attention``: transformers' keys
and values, torch's fused causal sdpa), against a cache the sparse kernel over all its keys. transformers scores
``ReLU(q . k * Di^-0.5)``: the positive scale is folded into the head weights (ReLU(a s) = s ReLU(a)). A mask
that is only causal (no padding) takes the fused top-k; a padded batch's mask goes through the indexer scores,
masked, then the contract's top-k (ties to the lower index), for the queries past index_topk (the others select
every key their mask shows). Calls with a cache other than transformers' dynamic one (a static cache returns its
whole preallocated buffer) run transformers' own forward, and so do calls asking for the attention weights
(``output_attentions``: the sparse kernels never form them; eager returns transformers' weights, sdpa none with
transformers' own warning): each says so once per model (a ``UserWarning``).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from glm5_core.ops import dsa, moe
from glm5_core.ops.mla import causal_mask


# ---- DSA indexer --------------------------------------------------------------------------------------
def _topk_of_masked_scores(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The top-k contract on scores [B, T, S] already -inf where not visible: int32 [B, T, topk], -1 padded."""
    B, T, S = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]  # [B, T, <=topk]
    if order.shape[-1] < topk:
        order = torch.cat((order, order.new_full((B, T, topk - order.shape[-1]), -1)), dim=-1)
    visible = torch.gather(scores, -1, order.clamp(min=0)) > float("-inf")  # [B, T, topk]
    return torch.where(visible & (order >= 0), order, torch.full_like(order, -1)).to(torch.int32)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb_interleave`` for one tensor x [B, T, h, Dr] (cos / sin [B, T, Dr],
    its cat(freqs, freqs)): pairs (x[2i], x[2i+1]) rotated, written out as [rotated evens; rotated odds]."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)  # [B, T, 1, Dr/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def indexer_keys(indexer, hidden_states: torch.Tensor, cos, sin, cache) -> torch.Tensor:
    """transformers' indexer keys of the new tokens, appended to its cache: [B, S, Di]."""
    B, T, _ = hidden_states.shape
    Dr, Di = indexer.qk_rope_head_dim, indexer.head_dim
    k = indexer.k_norm(indexer.wk(hidden_states)).view(B, T, 1, Di)  # [B, T, 1, Di]
    k_rot, k_pass = torch.split(k, [Dr, Di - Dr], dim=-1)
    k = torch.cat((rotate_pairs(k_rot, cos, sin), k_pass), dim=-1).view(B, T, Di)  # [B, T, Di]
    return cache.update_indexer(k, indexer.layer_idx) if cache is not None else k


def indexer_topk(indexer, hidden_states: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, cos, sin,
                 start: int, visible: Optional[torch.Tensor], backend) -> torch.Tensor:
    """transformers' GlmMoeDsaIndexer scores of these queries (slots start.., over keys [B, S, Di]),
    glm5-core's top-k: int32 [B, T, K] (-1 past the visible keys)."""
    B, T, _ = hidden_states.shape
    Dr, Di = indexer.qk_rope_head_dim, indexer.head_dim
    q = indexer.wq_b(q_resid).view(B, T, indexer.n_heads, Di)  # [B, T, Hi, Di]
    q_rot, q_pass = torch.split(q, [Dr, Di - Dr], dim=-1)
    q = torch.cat((rotate_pairs(q_rot, cos, sin), q_pass), dim=-1)  # [B, T, Hi, Di]
    head_scale = indexer.n_heads ** -0.5 * indexer.softmax_scale  # transformers' score scale, folded in
    w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * head_scale  # [B, T, Hi]
    if visible is None:
        return dsa.indexer_topk(q, keys, w, indexer.index_topk, start_pos=start, backend=backend)
    scores = dsa.indexer_scores(q, keys, w, start_pos=start, backend=backend)  # [B, T, S], -inf if not causal
    return _topk_of_masked_scores(scores.masked_fill(~visible, float("-inf")), indexer.index_topk)


def every_visible_key(batch: int, num_queries: int, start: int, topk: int, device) -> torch.Tensor:
    """The selection of queries at slots start.. that see at most ``topk`` keys: all of them, int32
    [B, T, topk] (keys 0..slot, then -1). The contract orders them by score; attention does not care."""
    slots = torch.arange(start, start + num_queries, device=device).view(num_queries, 1)  # [T, 1]
    keys = torch.arange(topk, device=device).view(1, topk)  # [1, K]
    idx = torch.where(keys <= slots, keys, torch.full_like(keys, -1))  # [T, K]
    return idx.to(torch.int32).expand(batch, num_queries, topk)


# ---- attention ----------------------------------------------------------------------------------------
def visible_keys_in_order(visible: torch.Tensor, topk: int) -> torch.Tensor:
    """The selection of queries that see at most ``topk`` keys, under a padded mask visible bool [B, T, S]:
    their visible keys in index order, then -1: int32 [B, T, topk] (equal scores sort stably)."""
    no_scores = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)  # [B, T, S]
    return _topk_of_masked_scores(no_scores.masked_fill(~visible, float("-inf")), topk)


def dense_causal_attention(attn, q_nope: torch.Tensor, q_rot: torch.Tensor, c_kv: torch.Tensor,
                           k_rot: torch.Tensor, visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MLA of fresh queries over their own keys (slot 0 on), in the expanded form transformers' sdpa
    attention computes: keys and values through ``kv_b_proj``, then torch's fused attention, causal (the
    future half skipped) or under a padded mask visible bool [B, T, T] (a query that sees no key: zeros, as
    the sparse kernel gives). q_nope [B, T, H, Dn], q_rot [B, T, H, Dr], c_kv [B, T, C], k_rot [B, T, Dr]
    -> [B, T, H, Dv]."""
    B, T, H, Dn = q_nope.shape
    Dr = q_rot.shape[-1]
    k_nope, value = torch.split(attn.kv_b_proj(c_kv).view(B, T, H, -1), [Dn, attn.v_head_dim], dim=-1)
    query = torch.cat((q_nope, q_rot), dim=-1).transpose(1, 2)  # [B, H, T, Dn+Dr]
    key = torch.cat((k_nope, k_rot.view(B, T, 1, Dr).expand(B, T, H, Dr)), dim=-1).transpose(1, 2)  # same
    if visible is None:
        out = F.scaled_dot_product_attention(query, key, value.transpose(1, 2), is_causal=True,
                                             scale=attn.scaling)  # [B, H, T, Dv]
        return out.transpose(1, 2)  # [B, T, H, Dv]
    out = F.scaled_dot_product_attention(query, key, value.transpose(1, 2), attn_mask=visible.unsqueeze(1),
                                         scale=attn.scaling).transpose(1, 2)  # [B, T, H, Dv]
    sees_a_key = visible.any(dim=-1).view(B, T, 1, 1)
    return torch.where(sees_a_key, out, torch.zeros((), dtype=out.dtype))  # [B, T, H, Dv]


def _visible_keys(attention_mask: Optional[torch.Tensor], start: int, B: int, T: int, S: int
                  ) -> Optional[torch.Tensor]:
    """None when transformers' mask [B, 1, T, S] is exactly causal from ``start``, else the visible keys
    bool [B, T, S] (a padded batch). transformers' masks are bool (sdpa) or additive (eager: 0 = visible)."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, 0]  # [B, T, S]
    visible = mask if mask.dtype == torch.bool else mask == 0
    if tuple(visible.shape) == (B, T, S) and torch.equal(visible, causal_mask(start, B, T, S, visible.device)):
        return None
    return visible.expand(B, T, S)


def _runs_here(cache, layer_idx: int) -> bool:
    """This forward needs a cache whose ``update`` returns exactly the filled slots (transformers' dynamic
    indexed layer); a static cache returns its whole buffer."""
    if cache is None:
        return True
    from transformers.cache_utils import DynamicIndexedLayer

    layers = getattr(cache, "layers", None)
    return layers is not None and layer_idx < len(layers) and type(layers[layer_idx]) is DynamicIndexedLayer


def _fallback_reason(self, cache, kwargs) -> Optional[str]:
    """Why this call runs transformers' own attention forward (None: it runs glm5-core's)."""
    if not _runs_here(cache, self.layer_idx):
        layers = getattr(cache, "layers", None)
        layer = layers[self.layer_idx] if layers and self.layer_idx < len(layers) else cache
        kind = type(layer).__name__
        return (f"kernelize: a {type(cache).__name__} ({kind} layers) runs transformers' own attention, not "
                f"glm5-core's kernels (glm5-core's needs transformers' dynamic cache, whose update returns the filled "
                f"slots only)")
    wants = kwargs.get("output_attentions", getattr(self.config, "output_attentions", False))
    if wants:  # eager: its weights; sdpa: none, and transformers' own warning about it
        return (f"kernelize: output_attentions=True runs transformers' own ({self.config._attn_implementation}) "
                f"attention for these calls, so that the weights returned are transformers'; glm5-core's sparse "
                f"kernels never form them")
    return None


def _say_once(self, reason: str) -> None:
    """One UserWarning per model and reason (``kernelize`` gives the model's attention modules one set)."""
    said = getattr(self, "glm5_notices", None)
    if said is None or reason not in said:
        if said is not None:
            said.add(reason)
        warnings.warn(reason, UserWarning, stacklevel=3)


def attention_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                      attention_mask: Optional[torch.Tensor] = None, cache=None, position_ids=None,
                      prev_topk_indices: Optional[torch.Tensor] = None, past_key_values=None, **kwargs):
    """GlmMoeDsaAttention.forward: returns (output [B, T, D], None, the top-k of the queries that needed
    one: int32 [B, T - n_all, K], what the next "shared" layer reuses).

    DSA selects every visible key for the first ``n_all`` queries (slots below index_topk): those run dense
    MLA (``dense_causal_attention`` in a prefill, the sparse kernel over all keys against a cache) and need no indexer
    scores (under a padded mask too: its visible keys); the others run the indexer's top-k and the sparse
    kernel."""
    reason = _fallback_reason(self, cache if cache is not None else past_key_values, kwargs)
    if reason is not None:
        _say_once(self, reason)
        named = {"cache": cache} if past_key_values is None else {"past_key_values": past_key_values}  # as given
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **named,
                                  position_ids=position_ids, prev_topk_indices=prev_topk_indices, **kwargs)
    cache = cache if cache is not None else past_key_values  # transformers 5.18 calls it past_key_values
    B, T, _ = hidden_states.shape
    H, Dn, Dr, Dv, C = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [B, T, Q]
    q = self.q_b_proj(q_resid).view(B, T, H, Dn + Dr)  # [B, T, H, Dn+Dr]
    q_nope, q_rot = torch.split(q, [Dn, Dr], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [C, Dr], dim=-1)
    c_kv = self.kv_a_layernorm(kv_pass).view(B, 1, T, C)  # transformers' single-head cache layout
    cos, sin = position_embeddings
    q_rot = rotate_pairs(q_rot, cos, sin)  # [B, T, H, Dr]
    k_rot = rotate_pairs(k_rot.view(B, T, 1, Dr), cos, sin).view(B, 1, T, Dr)  # transformers' cache layout
    if cache is not None:
        c_kv, k_rot = cache.update(c_kv, k_rot, self.layer_idx, kwargs=kwargs)  # [B, 1, S, C], [B, 1, S, Dr]
    c_kv, k_rot = c_kv[:, 0], k_rot[:, 0]  # [B, S, C], [B, S, Dr]
    S = c_kv.shape[1]
    start = S - T  # slots already in the cache: query t is at slot start + t
    K = self.config.index_topk
    keys = indexer_keys(self.indexer, hidden_states, cos, sin, cache) if self.indexer is not None else None

    visible = _visible_keys(attention_mask, start, B, T, S)
    n_all = max(0, min(T, K - start))  # leading queries that see <= K keys (padded or not): DSA selects them all
    w = self.kv_b_proj.weight.view(H, Dn + Dv, C)  # [H, Dn+Dv, C]: absorbed, never expanded over the cache
    w_uk, w_uv = w[:, :Dn], w[:, Dn:]
    parts = []
    if n_all and start == 0:
        parts.append(dense_causal_attention(self, q_nope[:, :n_all], q_rot[:, :n_all], c_kv[:, :n_all],
                                            k_rot[:, :n_all], None if visible is None
                                            else visible[:, :n_all, :n_all]))  # [B, n_all, H, Dv]
    elif n_all:
        every = (every_visible_key(B, n_all, start, K, c_kv.device) if visible is None
                 else visible_keys_in_order(visible[:, :n_all], K))  # [B, n_all, K]
        parts.append(dsa.sparse_decode(q_nope[:, :n_all], q_rot[:, :n_all], c_kv, k_rot, w_uk, w_uv, every,
                                       scale=self.scaling, backend=self.glm5_backend))
    topk = prev_topk_indices
    if n_all < T:
        if self.indexer is not None:
            tail = slice(n_all, T)
            topk = indexer_topk(self.indexer, hidden_states[:, tail], q_resid[:, tail], keys,
                                cos[:, tail], sin[:, tail], start + n_all,
                                None if visible is None else visible[:, tail], self.glm5_backend)
        elif topk is None:
            raise ValueError("prev_topk_indices: a 'shared' DSA layer needs the top-k of an earlier full layer")
        if start == 0 and dsa.prefers_expanded(heads=H, nope_dim=Dn, rope_dim=Dr, v_dim=Dv, kv_rank=C, queries=T,
                                               keys=S, topk=topk.shape[-1]):  # kv_b_proj over the S = T rows once
            k_nope, v = torch.split(self.kv_b_proj(c_kv).view(B, S, H, Dn + Dv), [Dn, Dv], dim=-1)  # [B, S, H, *]
            parts.append(dsa.sparse_prefill_expanded(q_nope[:, n_all:], q_rot[:, n_all:], k_nope, k_rot, v, topk,
                                                     scale=self.scaling, backend=self.glm5_backend))
        else:
            sparse = dsa.sparse_prefill if start == 0 else dsa.sparse_decode
            parts.append(sparse(q_nope[:, n_all:], q_rot[:, n_all:], c_kv, k_rot, w_uk, w_uv, topk,
                                scale=self.scaling, backend=self.glm5_backend))  # [B, T - n_all, H, Dv]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, T, H, Dv]
    return self.o_proj(out.reshape(B, T, H * Dv)), None, topk


# ---- MoE ----------------------------------------------------------------------------------------------
def router_forward(self, hidden_states: torch.Tensor):
    """GlmMoeDsaTopkRouter.forward: (router logits fp32 [N, E], weights fp32 [N, K], expert ids int64 [N, K])."""
    flat = hidden_states.view(-1, self.hidden_dim)  # [N, D]
    logits = F.linear(flat.float(), self.weight.float())  # [N, E]
    weights, ids = moe.route(logits, self.e_score_correction_bias, top_k=self.top_k, score_func="sigmoid",
                             n_group=self.num_group, topk_group=self.topk_group, renormalize=self.norm_topk_prob,
                             routed_scaling_factor=self.routed_scaling_factor, backend=self.glm5_backend)
    return logits, weights, ids.long()


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """GlmMoeDsaExperts.forward over its fused weights gate_up_proj [E, 2F, D] (gate rows first), down_proj
    [E, D, F]: the routed SwiGLU experts of glm5-core, summed in slot order. Returns [N, D]."""
    F_ = self.intermediate_dim
    w_gate, w_up = self.gate_up_proj[:, :F_], self.gate_up_proj[:, F_:]  # [E, F, D] views
    return moe.fused_experts(hidden_states, top_k_weights.to(hidden_states.dtype), top_k_index.to(torch.int32),
                             w_gate, w_up, self.down_proj, backend=self.glm5_backend)
