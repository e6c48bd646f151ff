"""Multi-token prediction: one module applied recursively (GLM-5 shares it across depths).

Depth d (1-based) at position t combines the previous depth's hidden state at t with the embedding of
token t + d and predicts token t + 1 + d:
    h_d = Layer(eh_proj([enorm(embed(x[t + d])); hnorm(h_{d-1}[t])]));  logits_d = lm_head(shared_head.norm(h_d))
The embedding and lm_head are the main model's. Stored as layer index num_hidden_layers.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from glm5_core import registry
from glm5_core.model.block import DecoderLayer, HybridDecoderLayer
from glm5_core.model.config import GLM5Config
from glm5_core.model.norm import RMSNorm
from glm5_core.model.state import ForwardState


class SharedHeadNorm(nn.Module):
    """Holds the MTP's own final norm (``shared_head.norm``); the head itself is the model's lm_head."""

    def __init__(self, cfg: GLM5Config):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: GLM5Config, backend: registry.BackendArg, expert_shard: Optional[tuple[int, int]] = None):
        super().__init__(cfg, cfg.num_hidden_layers, "full", backend, expert_shard)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHeadNorm(cfg)

    def predict(self, hidden: torch.Tensor, next_embeds: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """hidden [B, T, D] (previous depth), next_embeds [B, T, D] -> this depth's hidden [B, T, D]."""
        merged = torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1)  # [B, T, 2D]
        return self(self.eh_proj(merged), state)


class HybridMTPLayer(HybridDecoderLayer):
    """GLM-5.3's MTP module (layer ``num_hidden_layers``; transformers loads none and skips ``layers.N.*``): the
    same enorm / hnorm / eh_proj / shared_head.norm as GLM-5's around an indexed hybrid layer with its own
    k-pool indexer; the merged input enters as ``hc_mult`` copies and leaves as their mean (as the main model)."""

    def __init__(self, cfg: GLM5Config, backend: registry.BackendArg, expert_shard: Optional[tuple[int, int]] = None):
        super().__init__(cfg, cfg.num_hidden_layers, backend, expert_shard)
        self.hc_mult = cfg.hc_mult
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHeadNorm(cfg)

    def predict(self, hidden: torch.Tensor, next_embeds: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """hidden [B, T, D] (previous depth, streams collapsed), next_embeds [B, T, D] -> [B, T, D]."""
        merged = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))  # [B, T, D]
        state.shared_topk = None
        streams = merged.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()
        return self(streams, state).mean(dim=2)
