"""One decoder layer: pre-norm MLA attention, then a dense SwiGLU MLP or an MoE layer."""
from __future__ import annotations

import torch
from torch import nn

from glm5_core import registry
from glm5_core.model.attention import MLA
from glm5_core.model.config import GLM5Config
from glm5_core.model.mlp import MLP
from glm5_core.model.moe import MoE
from glm5_core.model.norm import RMSNorm
from glm5_core.model.state import ForwardState


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GLM5Config, layer_idx: int, indexer_type: str, backend: registry.BackendArg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, layer_idx, indexer_type, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, layer_idx - cfg.first_k_dense_replace, backend)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, state: ForwardState) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), state)
        ffn_in = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            main = state.record_topk  # False in the MTP module: it neither replays nor records
            replay = state.routing_replay[self.mlp.moe_index] if main and state.routing_replay is not None else None
            ffn_out, counts, ids = self.mlp.route_and_run(ffn_in, replay)
            previous = state.expert_counts[self.mlp.moe_index]
            state.expert_counts[self.mlp.moe_index] = counts if previous is None else previous + counts
            if main:
                state.expert_ids.append(ids)
                if state.cache is not None and state.cache.expert_ids:
                    state.cache.write_expert_ids(self.mlp.moe_index, ids, state.start_pos)
        else:
            ffn_out = self.mlp(ffn_in)
        return h + ffn_out
