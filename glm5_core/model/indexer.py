"""DSA lightning indexer: scores which keys each query should attend to.

Legend: B batch, T queries, S key slots, Hi index_n_heads, Di index_head_dim, Dr qk_rope_head_dim,
Q q_lora_rank, D hidden_size.

q = wq_b(q_a_layernorm output) viewed [B, T, Hi, Di]; k = k_norm(wk(x)) [B, T, Di] (one key head);
the first Dr dims of q and k get RoPE. Head weights w = weights_proj(x) * Hi^-0.5 [B, T, Hi].
Scores and top-k are computed by ``glm5_core.ops.dsa``.
"""
from __future__ import annotations

import torch
from torch import nn

from glm5_core.model.config import GLM5Config
from glm5_core.model.rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, cfg: GLM5Config):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.interleave = cfg.indexer_rope_interleave
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope_front(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        roped = apply_rope(x[..., :self.rope_dim], cos, sin, interleave=self.interleave)
        return torch.cat((roped, x[..., self.rope_dim:]), dim=-1)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D], q_latent [B, T, Q] -> q [B, T, Hi, Di], k [B, T, Di], w [B, T, Hi]."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.n_heads, self.head_dim)  # [B, T, Hi, Di]
        q = self._rope_front(q, cos, sin)
        k = self._rope_front(self.k_norm(self.wk(x)), cos, sin)  # [B, T, Di]
        # in weights_proj's dtype: transformers keeps it fp32 in fp16 checkpoints (its _keep_in_fp32_modules)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)) * self.n_heads ** -0.5  # [B, T, Hi]
        return q, k, w
