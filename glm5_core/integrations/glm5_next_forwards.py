"""glm5-core forwards for the text modules of transformers' ``Glm5NextForConditionalGeneration`` (GLM-5.3), bound
by ``kernelize``. Read against transformers' ``models/glm5_next/modeling_glm5_next.py`` (5.25).

Each replaces one module's ``forward``, reads that module's own parameters (``state_dict`` unchanged) and computes
what transformers' forward computes through ``glm5_core.ops`` entry points on ``module.glm5_backend``:

  * ``Glm5NextTextAttention`` (NoPE MLA + DSA): projections transformers', the latent in transformers' cache,
    then ``dsa.sparse_prefill`` / ``dsa.sparse_decode`` (absorbed: kv_b_proj never expanded over the cache) over
    the indexer's selection (or the previous layer's, for a "shared" layer);
  * ``Glm5NextTextIndexer``: the k-pool top-k (``dsa.kpool_topk``: ties to the lower group)
    over the pooled keys transformers' cache keeps (``update_indexer``); a padded batch (a mask with zeros) runs
    transformers' own indexer, whose pools start at each row's first real token;
  * ``Glm5NextTextLinearAttention`` (KDA): the conv through transformers' ``causal_conv1d_forward`` (its cache
    holds the conv state), the delta rule through ``kda.chunked`` / ``kda.recurrent`` from the cache's recurrent
    state; a cache that keeps intermediate recurrent states (speculative decoding) runs transformers' forward;
  * ``Glm5NextTextHyperConnection``: the Sinkhorn normalisation through ``mhc.sinkhorn``;
  * ``Glm5NextTextTopkRouter``: ``moe.route`` (the glm_moe_dsa router forward: the same module);
  * ``Glm5NextTextExperts``: ``moe.fused_experts`` with the clamped SwiGLU (``swiglu_limit``).
Embeddings, norms, dense MLPs, the shared experts, the stream mixing and lm_head stay transformers'. Calls with
another cache than transformers' dynamic one run transformers' own forward.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

from glm5_core.integrations.glm_moe_dsa_forwards import _runs_here
from glm5_core.ops import dsa, kda, mhc, moe


def _hf_module(module) -> object:
    return sys.modules[type(module).__module__]


# ---- indexed attention (NoPE MLA + k-pool DSA) --------------------------------------------------------------
def attention_forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor], cache=None,
                      prev_topk_indices: Optional[torch.Tensor] = None, past_key_values=None, **kwargs):
    """Glm5NextTextAttention.forward: (output [B, T, D], None, the top-k when the next layer shares it)."""
    cache = cache if cache is not None else past_key_values
    if not _runs_here(cache, self.layer_idx) or self.qk_rope_head_dim:
        return type(self).forward(self, hidden_states, attention_mask, cache=cache,
                                  prev_topk_indices=prev_topk_indices, **kwargs)
    B, T, _ = hidden_states.shape
    H, Dn, Dv, C = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))  # [B, T, Q]
    q = self.q_b_proj(q_resid).view(B, T, H, Dn)
    c_kv = self.kv_a_layernorm(self.kv_a_proj_with_mqa(hidden_states)).view(B, 1, T, C)
    k_rot = c_kv.new_zeros(B, 1, T, 0)
    if cache is not None:
        c_kv, k_rot = cache.update(c_kv, k_rot, self.layer_idx, kwargs=kwargs)
    c_kv = c_kv[:, 0]  # [B, S, C]
    S = c_kv.shape[1]
    if self.indexer is not None:
        topk = self.indexer(hidden_states=hidden_states, q_resid=q_resid, attention_mask=attention_mask, cache=cache)
    elif prev_topk_indices is None:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
    else:
        topk = prev_topk_indices
    w = self.kv_b_proj.weight.view(H, Dn + Dv, C)
    sparse = dsa.sparse_prefill if S == T else dsa.sparse_decode
    out = sparse(q, q.new_zeros(B, T, H, 0), c_kv, c_kv.new_zeros(B, S, 0), w[:, :Dn], w[:, Dn:],
                 topk.to(torch.int32), scale=self.scaling, backend=self.glm5_backend)  # [B, T, H, Dv]
    return self.o_proj(out.reshape(B, T, H * Dv)), None, topk if self.next_skip_topk else None


@torch.no_grad()
def indexer_forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor, attention_mask: torch.Tensor,
                    cache=None, past_key_values=None):
    """Glm5NextTextIndexer.forward on an unpadded batch: int32 [B, T, index_topk (+ index_kpool - 1)]."""
    cache = cache if cache is not None else past_key_values
    if (attention_mask is not None and not bool(attention_mask.all())) or not _runs_here(cache, self.layer_idx) \
            or self.qk_rope_head_dim:
        return type(self).forward(self, hidden_states, q_resid, attention_mask, cache)
    B, T, _ = hidden_states.shape
    Di = self.head_dim
    q = self.wq_b(q_resid).view(B, T, self.n_heads, Di)
    k = self.k_norm(self.wk(hidden_states))  # [B, T, Di]
    gates = F.linear(hidden_states, self.index_kpool_compress_gate)
    packed = torch.cat([k, gates, k.new_ones(B, T, 1)], dim=-1)  # transformers' packed indexer state
    if cache is not None:
        packed = cache.update_indexer(packed, self.layer_idx)
    keys, gates = packed[..., :Di], packed[..., Di:2 * Di]
    start = packed.shape[1] - T
    w = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
    return dsa.kpool_topk(q, keys, w, gates, self.index_kpool_compress_ape, topk=self.index_topk,
                          kpool=self.index_kpool, select_tail=self.index_kpool_always_select_tail,
                          scale=self.softmax_scale, start_pos=start, backend=self.glm5_backend)


# ---- KDA ------------------------------------------------------------------------------------------------------
def linear_attention_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None,
                             cache_params=None, **kwargs):
    """Glm5NextTextLinearAttention.forward with glm5-core's KDA (chunked prefill, recurrent decode)."""
    cache = cache if cache is not None else cache_params
    if cache is not None and cache.get_recurrent_states_to_keep(self.layer_idx):
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    hf = _hf_module(self)
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    B, T = hidden_states.shape[:2]
    shape = (B, T, -1, self.head_dim)
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)],
                      dim=-1).transpose(1, 2)
    state = cache.get_recurrent_state(self.layer_idx, state_idx=0) if cache is not None else None
    mixed = hf.causal_conv1d_forward(self.conv1d, mixed, cache, self.layer_idx, activation=self.activation)
    q, k, v = (t.reshape(shape) for t in torch.split(mixed.transpose(1, 2), [self.qkv_dim] * 3, dim=-1))
    g = self.forget_gate(hidden_states)
    beta = torch.sigmoid(self.b_proj(hidden_states))
    initial = None if state is None else state.to(torch.float32)
    if state is not None and T == 1:
        o, final = kda.recurrent(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                                 use_qk_l2norm=True, backend=self.glm5_backend)
    else:
        o, final = kda.chunked(q, k, v, g, beta, initial_state=initial, output_final_state=cache is not None,
                               use_qk_l2norm=True, backend=self.glm5_backend)
    if cache is not None:
        cache.update_recurrent_state(final.to(torch.float32), self.layer_idx)
    gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(shape)
    return self.o_proj(self.o_norm(o.to(hidden_states.dtype), gate).reshape(B, T, -1))


# ---- mHC ------------------------------------------------------------------------------------------------------
def hyper_connection_forward(self, hidden_streams: torch.Tensor):
    """Glm5NextTextHyperConnection.forward: (post [B, S, N], comb [B, S, N, N], collapsed [B, S, D])."""
    B, S = hidden_streams.shape[:2]
    n = self.hc_mult
    flat = F.linear(self.input_norm(hidden_streams.view(B, S, -1).float()), self.fn.float())
    pre_w, post_w, comb_w = flat.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = self.base.split([n, n, n * n])
    pre_s, post_s, comb_s = self.scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    logits = comb_w.view(B, S, n, n) * comb_s + comb_b.view(n, n)
    comb = mhc.sinkhorn(logits.reshape(-1, n, n), iters=self.hc_sinkhorn_iters, eps=self.hc_eps,
                        backend=self.glm5_backend).view(B, S, n, n)
    collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
    return post, comb, collapsed


# ---- MoE ------------------------------------------------------------------------------------------------------
def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Glm5NextTextExperts.forward over gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F]: the
    routed experts with transformers' clamp (gate <= L, |up| <= L), summed in slot order. Returns [N, D]."""
    F_ = self.intermediate_dim
    return moe.fused_experts(hidden_states, top_k_weights.to(hidden_states.dtype), top_k_index.to(torch.int32),
                             self.gate_up_proj[:, :F_], self.gate_up_proj[:, F_:], self.down_proj,
                             swiglu_limit=self.swiglu_limit, backend=self.glm5_backend)
