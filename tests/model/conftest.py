"""Small model configurations for tests/model (CPU, 2 cores: keep shapes small)."""
from __future__ import annotations

import pytest
import torch

from glm5_core.model import GLM5Config, GLM5ForCausalLM


def small_config(**overrides) -> GLM5Config:
    """3 layers (1 dense + 2 MoE), full / shared / full indexers, top-k 8 so sparse matters from 9 tokens."""
    base = dict(
        vocab_size=61, hidden_size=32, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
        moe_intermediate_size=16, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2,
        num_attention_heads=3, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6,
        v_head_dim=10, rope_theta=500.0, index_n_heads=3, index_head_dim=10, index_topk=8,
        indexer_types=["full", "shared", "full"], num_nextn_predict_layers=1, max_position_embeddings=64,
        initializer_range=0.2,
    )
    base.update(overrides)
    return GLM5Config.tiny(**base)


def build(cfg: GLM5Config, dtype: torch.dtype = torch.float64, seed: int = 0) -> GLM5ForCausalLM:
    torch.manual_seed(seed)
    model = GLM5ForCausalLM(cfg, backend="cpu")
    model.reset_parameters(seed=seed)
    return model.to(dtype).eval()


@pytest.fixture
def make_config():
    """Factory fixture: small_config(**overrides)."""
    return small_config


@pytest.fixture
def make_model():
    """Factory fixture: build(cfg, dtype=float64, seed=0)."""
    return build


@pytest.fixture
def small_model() -> GLM5ForCausalLM:
    return build(small_config())
