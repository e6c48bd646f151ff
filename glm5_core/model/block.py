"""One decoder layer: pre-norm MLA attention, then a dense SwiGLU MLP or an MoE layer; GLM-5.3's hybrid layer
(:class:`HybridDecoderLayer`: KDA or indexed attention, each sub-block between two mHC sites)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from glm5_core import registry
from glm5_core.model.attention import MLA
from glm5_core.model.config import GLM5Config
from glm5_core.model.mlp import MLP
from glm5_core.model.moe import MoE
from glm5_core.model.norm import RMSNorm
from glm5_core.model.state import ForwardState

__all__ = ["DecoderLayer", "HybridDecoderLayer", "run_ffn"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GLM5Config, layer_idx: int, indexer_type: str, backend: registry.BackendArg,
                 expert_shard: Optional[tuple[int, int]] = None):
        """``expert_shard``: see :class:`MoE`."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, layer_idx, indexer_type, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, layer_idx - cfg.first_k_dense_replace, backend, expert_shard=expert_shard)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, state: ForwardState) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), state)
        return h + run_ffn(self.mlp, self.post_attention_layernorm(h), state)


def run_ffn(mlp: nn.Module, ffn_in: torch.Tensor, state: ForwardState) -> torch.Tensor:
    """The feed-forward sub-block: an MoE layer (routing replay, expert counts and ids recorded) or a dense MLP."""
    if isinstance(mlp, MoE):
        main = state.record_topk  # False in the MTP module: it neither replays nor records
        replay = state.routing_replay[mlp.moe_index] if main and state.routing_replay is not None else None
        ffn_out, counts, ids = mlp.route_and_run(ffn_in, replay)
        previous = state.expert_counts[mlp.moe_index]
        state.expert_counts[mlp.moe_index] = counts if previous is None else previous + counts
        if main:
            state.expert_ids.append(ids)
            if state.cache is not None and state.cache.expert_ids:
                state.cache.write_expert_ids(mlp.moe_index, ids, state.start_pos)
        return ffn_out
    return mlp(ffn_in)


class HybridDecoderLayer(nn.Module):
    """GLM-5.3's decoder layer (transformers' ``Glm5NextTextDecoderLayer``): the ``hc_mult`` streams [B, T, N, D]
    collapse (``attn_hc``) into the input of KDA (``linear_attention``) or indexed NoPE MLA, whose output is mixed
    back into the streams; then the same around the MLP / MoE (``ffn_hc``). Layer ``num_hidden_layers`` (the MTP
    module's) is an indexed layer with its own indexer."""

    def __init__(self, cfg: GLM5Config, layer_idx: int, backend: registry.BackendArg,
                 expert_shard: Optional[tuple[int, int]] = None):
        """``expert_shard``: see :class:`MoE`."""
        super().__init__()
        from glm5_core.model.hyper_connection import HyperConnection
        from glm5_core.model.indexed_attention import IndexedMLA

        main = layer_idx < cfg.num_hidden_layers
        self.layer_idx = layer_idx
        self.kind = cfg.layer_kinds()[layer_idx] if main else "indexed_attention"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "linear_attention":
            self.self_attn = build_kda(cfg, backend)
        else:
            self.self_attn = IndexedMLA(cfg, layer_idx, cfg.layer_indexer_types()[layer_idx] if main else "full",
                                        backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, layer_idx - cfg.first_k_dense_replace, backend, swiglu_limit=cfg.swiglu_limit,
                           expert_shard=expert_shard)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, swiglu_limit=cfg.swiglu_limit)
        hc = dict(hidden_size=cfg.hidden_size, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
                  hc_eps=cfg.hc_eps, rms_norm_eps=cfg.rms_norm_eps, backend=backend)
        self.attn_hc = HyperConnection(**hc)
        self.ffn_hc = HyperConnection(**hc)

    def forward(self, streams: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """streams [B, T, N, D] -> [B, T, N, D]."""
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        if self.kind == "linear_attention":
            out = kda_forward(self.self_attn, self.layer_idx, x, state)
            state.shared_topk = None  # transformers hands a layer the top-k of the layer just before it only
        else:
            out = self.self_attn(x, state)
        streams = self.attn_hc.mix(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = run_ffn(self.mlp, self.post_attention_layernorm(x), state)
        return self.ffn_hc.mix(streams, out, post, comb)


def build_kda(cfg: GLM5Config, backend: registry.BackendArg) -> nn.Module:
    """The KDA layer (``linear_attention``) of a glm5_next config."""
    from glm5_core.model.linear_attention import KimiDeltaAttention

    return KimiDeltaAttention(hidden_size=cfg.hidden_size, linear_num_heads=cfg.linear_num_heads,
                              linear_head_dim=cfg.linear_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
                              linear_lower_bound=cfg.linear_lower_bound, rms_norm_eps=cfg.rms_norm_eps,
                              backend=backend)


def kda_forward(kda: nn.Module, layer_idx: int, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
    """Run a KDA layer on x [B, T, D], reading and updating its conv + recurrent state in the cache."""
    if state.cache is None:
        return kda(x)[0]
    if isinstance(state.start_pos, torch.Tensor) and x.shape[1] > 1:
        raise ValueError("start_pos: expected an int when prefilling a model with KDA layers (their recurrent "
                         "state cannot skip the padding of ragged rows), got a tensor")
    kda_state = state.cache.kda_state(layer_idx)
    out, new_state = kda(x, None if state.fresh else kda_state, use_cache=True)
    state.cache.set_kda_state(layer_idx, new_state)
    return out
