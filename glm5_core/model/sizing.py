"""Sizes a GLM5Config implies, computed from the config alone (nothing is built or allocated).

``parameter_count`` is exact: the tests compare it with the built model's parameters. The per-token figures
are lower bounds used to refuse runs that cannot fit (see ``glm5_core.memory_budget``): the cache widths the
engine allocates, and the activations a training forward must keep for its backward pass (the input of every
weight-gradient matmul, in floats), whatever the backend.
"""
from __future__ import annotations

from glm5_core.model.config import GLM5Config


def _full_indexers(cfg: GLM5Config) -> int:
    types = cfg.layer_indexer_types()[:cfg.num_hidden_layers]
    return sum(1 for kind in types if kind == "full") + max(0, cfg.num_hidden_layers - len(types))


def _indexer_parameters(cfg: GLM5Config) -> int:
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    # wq_b, wk, k_norm (LayerNorm: weight and bias), weights_proj
    return cfg.q_lora_rank * heads * dim + cfg.hidden_size * dim + 2 * dim + cfg.hidden_size * heads


def _attention_parameters(cfg: GLM5Config) -> int:
    """One MLA block without its indexer."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    q, c, dn, dr, dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    return D * q + q + q * H * (dn + dr) + D * (c + dr) + c + c * H * (dn + dv) + H * dv * D


def _moe_parameters(cfg: GLM5Config) -> int:
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    return cfg.n_routed_experts * D + cfg.n_routed_experts * 3 * D * F + 3 * D * F * cfg.n_shared_experts


def parameter_count(cfg: GLM5Config) -> int:
    """Parameters of ``GLM5ForCausalLM(cfg)`` (a tied lm_head counted once)."""
    D, L = cfg.hidden_size, cfg.num_hidden_layers
    dense_layers = min(cfg.first_k_dense_replace, L)
    total = cfg.vocab_size * D * (1 if cfg.tie_word_embeddings else 2) + D  # embeddings, lm_head, final norm
    total += L * (2 * D + _attention_parameters(cfg))  # two norms and attention per layer
    total += _full_indexers(cfg) * _indexer_parameters(cfg)
    total += dense_layers * 3 * D * cfg.intermediate_size + (L - dense_layers) * _moe_parameters(cfg)
    if cfg.num_nextn_predict_layers:  # one MoE layer with a full indexer, enorm, hnorm, eh_proj, shared_head.norm
        total += 2 * D + _attention_parameters(cfg) + _indexer_parameters(cfg) + _moe_parameters(cfg)
        total += 3 * D + 2 * D * D
    return total


def cache_floats_per_token(cfg: GLM5Config) -> int:
    """KV-cache values one sequence position holds over all layers (latent, rope key, indexer key)."""
    return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + _full_indexers(cfg) * cfg.index_head_dim


def _layer_activation_floats(cfg: GLM5Config, ffn_width: int) -> int:
    D = cfg.hidden_size
    # layer input, attention-norm output, q latent, kv latent, attention output, ffn-norm output, ffn hidden
    return 3 * D + cfg.q_lora_rank + cfg.kv_lora_rank + cfg.num_attention_heads * cfg.v_head_dim + ffn_width


def activation_floats_per_token(cfg: GLM5Config, mtp_depths: int = 0) -> int:
    """A lower bound of the floats a training forward keeps per token for backward (logits excluded)."""
    dense_layers = min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    moe_width = (cfg.num_experts_per_tok + cfg.n_shared_experts) * cfg.moe_intermediate_size
    total = dense_layers * _layer_activation_floats(cfg, cfg.intermediate_size)
    total += (cfg.num_hidden_layers - dense_layers) * _layer_activation_floats(cfg, moe_width)
    return total + mtp_depths * (_layer_activation_floats(cfg, moe_width) + 2 * cfg.hidden_size)


def logit_floats_per_token(cfg: GLM5Config, mtp_depths: int = 0) -> int:
    """The logits of every head a training forward computes, per token."""
    return cfg.vocab_size * (1 + mtp_depths)
