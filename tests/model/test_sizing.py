"""The sizes the memory checks use are the model's own: parameter_count is the built model's parameter count and
cache_floats_per_token the KV cache's width, for configs that differ in every size the formulas read."""
import pytest

from glm5_core.model import GLM5Config, GLM5ForCausalLM, KVCache
from glm5_core.model.sizing import cache_floats_per_token, parameter_count

VARIANTS = [
    {},
    dict(tie_word_embeddings=True),
    dict(n_shared_experts=0, num_nextn_predict_layers=0),
    dict(n_shared_experts=2, first_k_dense_replace=0, indexer_types=["full", "shared", "shared", "shared"]),
    dict(first_k_dense_replace=4, indexer_types=None, num_attention_heads=3, v_head_dim=12, q_lora_rank=40),
    dict(hidden_size=48, kv_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=10, index_n_heads=3,
         index_head_dim=12, n_routed_experts=6, num_experts_per_tok=3, intermediate_size=100, vocab_size=300),
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_parameter_count_is_the_built_models(overrides):
    cfg = GLM5Config.tiny(**overrides)
    model = GLM5ForCausalLM(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides", VARIANTS)
def test_cache_floats_per_token_is_the_caches_width(overrides):
    cfg = GLM5Config.tiny(**overrides)
    cache = KVCache.new(cfg, 2, 5)
    held = sum(t.numel() for part in (cache.c_kv, cache.k_pe, cache.index_k) for t in part if t is not None)
    assert cache_floats_per_token(cfg) * 2 * 5 == held


def test_glm5_is_counted_without_building_it():
    # GLM-5's published size: ~744B parameters in total, 753.9B with the MTP layer
    assert round(parameter_count(GLM5Config.glm5()) / 1e8) == 7539
