"""GLM5Config: GLM-5's published config.json maps on without loss; bad values give one clear error each."""
from __future__ import annotations

import json

import pytest

from glm5_core.model import GLM5Config


def glm5_published_config() -> dict:
    """GLM-5's config.json keys and values as published
    (HF zai-org/GLM-5 config.json; transformers models/glm_moe_dsa)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "torch_dtype": "bfloat16",
        "vocab_size": 154880, "hidden_size": 6144, "num_hidden_layers": 78, "first_k_dense_replace": 3,
        "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "attention_bias": False,
        "attention_dropout": 0.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "indexer_rope_interleave": True,
        "num_nextn_predict_layers": 1, "max_position_embeddings": 202752, "rms_norm_eps": 1e-05,
        "hidden_act": "silu", "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": 0, "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820,
        "transformers_version": "5.0.0",
    }


def test_glm5_published_config_maps_onto_fields():
    cfg = GLM5Config.from_hf_dict(glm5_published_config())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.vocab_size) == (6144, 78, 3, 154880)
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (64, 2048, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_head_dim) == (192, 64, 256, 256)
    assert cfg.softmax_scale == 256 ** -0.5
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576  # latent cache per token per layer
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts,
            cfg.routed_scaling_factor) == (256, 8, 1, 2.5)
    assert cfg.rope_theta == 1e6 and cfg.rope_interleave and cfg.indexer_rope_interleave
    assert cfg.layer_indexer_types() == ["full"] * 78
    assert cfg == GLM5Config.glm5().replace(extra=cfg.extra)


def test_glm5_config_round_trips_key_for_key():
    published = glm5_published_config()
    cfg = GLM5Config.from_hf_dict(published)
    written = json.loads(json.dumps(cfg.to_hf_dict()))  # through JSON, as on disk
    for key, value in published.items():
        assert written[key] == value, key
    assert GLM5Config.from_hf_dict(written) == cfg


def test_tiny_round_trips_and_preserves_unknown_keys():
    cfg = GLM5Config.tiny().replace(extra={"my_tool_note": {"a": [1, 2]}, "eos_token_id": 3})
    again = GLM5Config.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg and again.extra["my_tool_note"] == {"a": [1, 2]}


@pytest.mark.parametrize("key, value", [
    ("scoring_func", "softmax"), ("hidden_act", "gelu"), ("topk_method", "greedy"), ("model_type", "llama"),
    ("rope_scaling", {"type": "yarn"}), ("attention_bias", True), ("moe_layer_freq", 2),
])
def test_behaviour_keys_other_than_implemented_are_rejected(key, value):
    d = glm5_published_config()
    d[key] = value
    with pytest.raises(ValueError, match=key):
        GLM5Config.from_hf_dict(d)


def test_rope_type_other_than_default_is_rejected():
    d = glm5_published_config()
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4}
    with pytest.raises(ValueError, match="rope_type"):
        GLM5Config.from_hf_dict(d)


BAD_VALUES = [
    ("hidden_size", 0, ValueError), ("hidden_size", 3.0, TypeError), ("vocab_size", -1, ValueError),
    ("num_hidden_layers", True, TypeError), ("first_k_dense_replace", 9, ValueError),
    ("num_experts_per_tok", 9, ValueError), ("n_group", 3, ValueError), ("topk_group", 2, ValueError),
    ("qk_rope_head_dim", 7, ValueError), ("index_head_dim", 4, ValueError), ("index_topk", 0, ValueError),
    ("indexer_types", ["full", "full"], ValueError), ("indexer_types", ["shared", "full", "full", "full"], ValueError),
    ("indexer_types", ["full", "full", "sparse", "full"], ValueError), ("rope_theta", float("nan"), ValueError),
    ("rms_norm_eps", 0.0, ValueError), ("routed_scaling_factor", -2.5, ValueError),
    ("norm_topk_prob", 1, TypeError), ("num_nextn_predict_layers", 2, ValueError),
    ("indexer_types", 4, TypeError), ("indexer_types", "full", TypeError),
    ("indexer_types", {"full": 1, "shared": 2}, TypeError), ("index_topk", 513, ValueError),
    ("vocab_size", 2 ** 24 + 1, ValueError), ("n_routed_experts", 2 ** 14 + 1, ValueError),
    ("num_hidden_layers", 2 ** 12 + 1, ValueError), ("initializer_range", "0.02", TypeError), ("extra", [], TypeError),
]


@pytest.mark.parametrize("field, value, error", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_bad_value_gives_one_clear_error(field, value, error):
    field_name = field
    with pytest.raises(error) as info:
        GLM5Config.tiny(**{field: value})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(field_name), message


@pytest.mark.parametrize("value", [4, "full", {"0": "full"}])
def test_from_hf_dict_names_indexer_types_that_are_not_a_list(value):
    d = glm5_published_config()
    d["indexer_types"] = value  # a string or a mapping is not read as its characters or keys
    with pytest.raises(TypeError, match="^indexer_types: expected a list"):
        GLM5Config.from_hf_dict(d)


def test_from_hf_dict_rejects_non_dict_and_bad_rope_parameters():
    with pytest.raises(TypeError, match="config"):
        GLM5Config.from_hf_dict(["not", "a", "dict"])
    d = glm5_published_config()
    d["rope_parameters"] = {"rope_theta": 1e6, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="rope_parameters"):
        GLM5Config.from_hf_dict(d)


def test_every_problem_of_the_fields_is_listed_with_a_prefix():
    from glm5_core.config_schema import TypeProblem

    cfg = GLM5Config.tiny().replace(extra={})
    object.__setattr__(cfg, "hidden_size", 0)
    object.__setattr__(cfg, "rope_interleave", "yes")
    problems = cfg.problems("model.")
    assert problems == ["model.hidden_size: expected an integer in [1, 16777216], got 0",
                        "model.rope_interleave: expected true or false, got 'yes'"]
    assert [isinstance(p, TypeProblem) for p in problems] == [False, True]


def test_index_topk_is_bounded_by_the_positions():
    with pytest.raises(ValueError, match=r"^index_topk: expected <= max_position_embeddings=512 \(a query never has "
                                         r"more keys\), got 16777216$"):
        GLM5Config.tiny(index_topk=2 ** 24)
    assert GLM5Config.tiny(index_topk=512).index_topk == 512


def test_a_layer_count_the_indexer_types_do_not_fit_names_num_hidden_layers():
    """The config fuzz set num_hidden_layers: 1 on the tiny preset (4 indexer_types): the line must name that key."""
    with pytest.raises(ValueError, match=r"^indexer_types: expected a list of 1 entries \(one per layer: "
                                         r"num_hidden_layers=1\), got \['full', 'full', 'shared', 'full'\]$"):
        GLM5Config.tiny(num_hidden_layers=1)
