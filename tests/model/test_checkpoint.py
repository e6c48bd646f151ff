"""HF glm_moe_dsa checkpoint directories: round trip, and validation of untrusted files."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5_core.model import GLM5ForCausalLM, load_pretrained, save_pretrained
from glm5_core.model.checkpoint import INDEX_NAME


def _ids(model, T=13):
    return torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bitwise(tmp_path, dtype, make_model, make_config):
    """A model in transformers' form (latent norms at 1e-6, interleaved RoPE) is written as it is."""
    model = make_model(make_config(latent_norm_eps=1e-6), dtype)
    with torch.no_grad():
        for bias in model.router_biases():  # non-zero selection biases must survive too
            bias.copy_(torch.linspace(-0.1, 0.1, bias.numel()))
    files = save_pretrained(model, tmp_path, max_shard_bytes=64 * 1024)
    assert len(files) > 1, "small shards should split the checkpoint"
    loaded = load_pretrained(tmp_path, backend="cpu").eval()
    before, after = model.state_dict(), loaded.state_dict()
    assert list(before) == list(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name]), name
    with torch.no_grad():
        assert torch.equal(model(_ids(model), mtp_depths=1).logits, loaded(_ids(model), mtp_depths=1).logits)


def test_round_trip_of_the_tiny_preset_computes_the_same_function(tmp_path, make_model, make_config):
    """The tiny preset's latent norms use 1e-5: the file holds q_a_proj and the latent rows of
    kv_a_proj_with_mqa scaled by sqrt(1e-6 / 1e-5) for transformers' 1e-6, and nothing else differs."""
    model = make_model(make_config(), torch.float64)
    assert model.config.latent_norm_eps == 1e-5
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path).eval()
    assert loaded.config.latent_norm_eps == 1e-6
    before, after = model.state_dict(), loaded.state_dict()
    scale = (1e-6 / 1e-5) ** 0.5
    C = model.config.kv_lora_rank
    for name in before:
        want = before[name]
        if name.endswith("q_a_proj.weight"):
            want = want * scale
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            want = torch.cat((want[:C] * scale, want[C:]))
        else:
            assert torch.equal(before[name], after[name]), name
        torch.testing.assert_close(after[name], want, rtol=1e-15, atol=0)
    ids = _ids(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mtp_depths=1).logits, model(ids, mtp_depths=1).logits,
                                   rtol=1e-12, atol=1e-12)


def test_layout_uses_hf_names_and_a_consistent_index(tmp_path, make_model, make_config):
    model = make_model(make_config(), torch.float32)
    save_pretrained(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and config["torch_dtype"] == "float32"
    names = set(index["weight_map"])
    L = model.config.num_hidden_layers
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.indexer.k_norm.bias",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.1.mlp.experts.5.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                 f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight", f"model.layers.{L}.hnorm.weight",
                 f"model.layers.{L}.shared_head.norm.weight"):
        assert name in names, name
    assert not any(n.startswith("model.layers.1.self_attn.indexer") for n in names), "layer 1 is a shared layer"
    total = 0
    for file in set(index["weight_map"].values()):
        tensors = load_file(str(tmp_path / file))
        assert set(tensors) == {k for k, v in index["weight_map"].items() if v == file}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total


def test_tied_embeddings_store_one_matrix(tmp_path, make_model, make_config):
    model = make_model(make_config(tie_word_embeddings=True), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_pretrained(model, tmp_path)
    assert "lm_head.weight" not in json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.fixture
def saved(tmp_path, make_model, make_config):
    model = make_model(make_config(), torch.float32)
    save_pretrained(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    return tmp_path, index


def _rewrite_shard(path, index, name, transform):
    file = index["weight_map"][name]
    tensors = load_file(str(path / file))
    transform(tensors)
    save_file(tensors, str(path / file))


def test_wrong_shape_is_rejected(saved):
    path, index = saved
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _rewrite_shard(path, index, name, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(ValueError, match="kv_b_proj.weight: expected shape"):
        load_pretrained(path)


def test_wrong_dtype_is_rejected(saved):
    path, index = saved
    name = "model.norm.weight"
    _rewrite_shard(path, index, name, lambda t: t.__setitem__(name, t[name].double()))
    with pytest.raises(ValueError, match="model.norm.weight: expected dtype"):
        load_pretrained(path)


def test_unknown_and_missing_names_are_rejected(saved):
    path, index = saved
    name = "model.norm.weight"
    _rewrite_shard(path, index, name, lambda t: t.__setitem__("model.norm.wieght", t.pop(name)))
    index["weight_map"]["model.norm.wieght"] = index["weight_map"].pop(name)
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"unknown \['model.norm.wieght'\], missing \['model.norm.weight'\]"):
        load_pretrained(path)


def test_index_disagreeing_with_shard_is_rejected(saved):
    path, index = saved
    files = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == files[0])
    index["weight_map"][name] = files[1]
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="contents disagree"):
        load_pretrained(path)


@pytest.mark.parametrize("bad_file", ["../outside.safetensors", "/etc/passwd", "weights.bin"])
def test_index_file_names_must_be_plain_safetensors(saved, bad_file):
    path, index = saved
    index["weight_map"]["model.norm.weight"] = bad_file
    (path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="plain"):
        load_pretrained(path)


def test_missing_shard_and_non_safetensors_payload(saved):
    path, index = saved
    files = sorted(set(index["weight_map"].values()))
    os.remove(path / files[0])
    with pytest.raises(FileNotFoundError, match=files[0]):
        load_pretrained(path)
    (path / files[0]).write_bytes(b"\x80\x04\x95 pickled data, not safetensors")
    with pytest.raises(ValueError, match="not a valid safetensors"):
        load_pretrained(path)


def test_bad_config_values_are_rejected_before_weights(saved):
    path, _ = saved
    config = json.loads((path / "config.json").read_text())
    config["scoring_func"] = "softmax"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scoring_func"):
        load_pretrained(path)
    (path / "config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_pretrained(path)


def test_save_rejects_bad_arguments(tmp_path, make_model, make_config):
    model = make_model(make_config(), torch.float32)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_pretrained(model, tmp_path, max_shard_bytes=0)
    with pytest.raises(TypeError, match="model"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path)
    assert isinstance(model, GLM5ForCausalLM)
