"""load_pretrained on hostile checkpoints: a config.json that implies a huge model is rejected from the
shards' headers, before any tensor data is read and before anything but a ``meta`` model is built."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import glm5_core.model.checkpoint as checkpoint
from glm5_core.model import load_pretrained, save_pretrained
from glm5_core.model.config import MAX_EXPERTS, MAX_LAYERS, MAX_SIZE


@pytest.fixture
def saved(tmp_path, make_model, make_config):
    save_pretrained(make_model(make_config(), torch.float32), tmp_path)
    return tmp_path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def no_model_built(monkeypatch):
    """Fail the test if load_pretrained constructs a model at all."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was validated")
    monkeypatch.setattr(checkpoint, "GLM5ForCausalLM", refuse)


@pytest.fixture
def only_meta_models(monkeypatch):
    """Fail the test if load_pretrained builds a model on any device but ``meta``; count the builds."""
    real = checkpoint.GLM5ForCausalLM
    built = []

    def build_on_meta_only(*args, **kwargs):
        device = torch.get_default_device()
        if device.type != "meta":
            raise AssertionError(f"model built on {device}, expected meta")
        built.append(device)
        return real(*args, **kwargs)
    monkeypatch.setattr(checkpoint, "GLM5ForCausalLM", build_on_meta_only)
    return built


@pytest.fixture
def no_data_read(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tensor data was read before the headers were validated")
    monkeypatch.setattr(checkpoint, "_read_tensors", refuse)


def test_huge_vocab_in_config_is_rejected_before_any_model(saved, no_model_built):
    _edit_config(saved, vocab_size=10 ** 9)
    with pytest.raises(ValueError, match=rf"vocab_size: expected an integer in \[1, {MAX_SIZE}\], got 1000000000"):
        load_pretrained(saved)


def test_largest_allowed_vocab_is_rejected_from_the_headers(saved, only_meta_models, no_data_read):
    _edit_config(saved, vocab_size=MAX_SIZE)
    with pytest.raises(ValueError, match=rf"model.embed_tokens.weight: expected shape \({MAX_SIZE}, 32\) "
                                         r"\(from config.json\), got \(61, 32\)"):
        load_pretrained(saved)
    assert len(only_meta_models) == 1


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=4096), r"model.embed_tokens.weight: expected shape \(61, 4096\)"),
    (dict(moe_intermediate_size=MAX_SIZE), r"experts.0.gate_proj.weight: expected shape \(16777216, 32\)"),
    (dict(torch_dtype="float64", rms_norm_eps=1e-6), None),  # header-irrelevant keys: loads
])
def test_size_mismatches_are_named_without_reading_data(saved, only_meta_models, monkeypatch, changes, message):
    _edit_config(saved, **changes)
    if message is None:
        model = load_pretrained(saved)
        assert model.config.rms_norm_eps == 1e-6 and model.lm_head.weight.dtype == torch.float32
        return
    monkeypatch.setattr(checkpoint, "_read_tensors", lambda *a: pytest.fail("data read before the header check"))
    with pytest.raises(ValueError, match=message):
        load_pretrained(saved)


def test_more_layers_than_the_shards_hold_is_rejected_before_any_model(saved, no_model_built, make_config):
    _edit_config(saved, num_hidden_layers=MAX_LAYERS, indexer_types=None, mlp_layer_types=None)
    L = make_config().num_hidden_layers
    with pytest.raises(ValueError, match=rf"implies layers 0..{MAX_LAYERS - 1} .* the shards hold {L + 1} layers"):
        load_pretrained(saved)


def test_more_experts_than_the_shards_hold_is_rejected_before_any_model(saved, no_model_built, make_config):
    _edit_config(saved, n_routed_experts=MAX_EXPERTS)
    first_moe = make_config().first_k_dense_replace
    with pytest.raises(ValueError, match=rf"n_routed_experts={MAX_EXPERTS} in layer {first_moe}, "
                                         rf"the shards hold {make_config().n_routed_experts} experts"):
        load_pretrained(saved)


def test_unsupported_header_dtype_is_named(saved):
    from safetensors.torch import load_file, save_file

    (file,) = [f for f in os.listdir(saved) if f.endswith(".safetensors")]
    tensors = load_file(str(saved / file))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(saved / file))
    with pytest.raises(ValueError, match=r"model.norm.weight: expected one of the dtypes .*, got 'F8_E4M3'"):
        load_pretrained(saved)


def test_loaded_model_is_fully_materialised(saved, make_model, make_config):
    model = load_pretrained(saved)
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and not any(t.is_meta for t in tensors)
    rotary = model.model.rotary.inv_freq
    fresh = make_model(make_config(), torch.float32).model.rotary.inv_freq
    assert rotary.dtype == fresh.dtype and torch.equal(rotary, fresh)


_UNDER_MEMORY_LIMIT = textwrap.dedent("""
    import resource, sys
    import torch
    from glm5_core.model import load_pretrained

    def vm_bytes():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    limit = vm_bytes() + 1024 ** 3  # 1 GiB above what the process has mapped so far
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:  # the limit must bite: the embedding the config asks for is 2 GiB
        torch.empty(int(sys.argv[2]), 32)
        print("LIMIT-INEFFECTIVE")
    except (MemoryError, RuntimeError):
        pass
    try:
        load_pretrained(sys.argv[1])
        print("LOADED")
    except ValueError as exc:
        print("REJECTED", exc)
""")


def test_hostile_config_is_rejected_under_a_memory_limit(saved):
    """With the address space capped at 1 GiB above a fresh interpreter's, a checkpoint whose config asks
    for a 2 GiB embedding (plus as much for lm_head) is still rejected with the mismatch named."""
    _edit_config(saved, vocab_size=MAX_SIZE)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _UNDER_MEMORY_LIMIT, str(saved), str(MAX_SIZE)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LIMIT-INEFFECTIVE" not in out.stdout
    assert out.stdout.startswith("REJECTED checkpoint: model.embed_tokens.weight: expected shape"), out.stdout
