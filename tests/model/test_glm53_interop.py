"""GLM-5.3 (transformers ``glm5_next``) interop, tested against transformers itself (5.25,
``models/glm5_next/modeling_glm5_next.py``): tiny random ``Glm5NextForConditionalGeneration`` checkpoints that
transformers saves load here and give its fp32 logits within 1e-5 relative, and ours load in transformers the
same way; KDA and indexed layers, a ``shared`` indexer layer, sequences longer than ``index_topk`` ending in a
partial k-pool group; decode from the cache (KDA recurrent state, pooled indexer keys) equals the prefill.

The indexer's relu scores are exactly 0 for a group whose every head's dot product is negative; transformers'
``torch.topk`` orders such ties by no documented rule (glm5-core: the lower group), so the configs use 16
indexer heads, where an all-negative group does not occur, and the tests assert the selections agree."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.model.checkpoint import load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")
Glm5NextConfig = pytest.importorskip("transformers.models.glm5_next").Glm5NextConfig
Glm5NextForConditionalGeneration = transformers.Glm5NextForConditionalGeneration

VOCAB = 64
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=0, v_head_dim=8, qk_nope_head_dim=8, index_topk=8, index_head_dim=16,
            index_n_heads=16, layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                                           "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full", "full", "shared", "full"],
            linear_head_dim=8, linear_num_heads=2, hc_mult=2, index_kpool=4, pad_token_id=0)
VISION = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32, intermediate_size=16,
              projection_intermediate_size=16)
T = 23  # > index_topk = 8; 23 = 5 groups of 4 + a partial group of 3


def transformers_model(seed: int = 0, **text) -> Glm5NextForConditionalGeneration:
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=dict(TEXT, **text), vision_config=VISION))
    with torch.no_grad():  # move every text parameter off its init value (ones, zeros) so each one matters
        for name, p in model.named_parameters():
            if "visual" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def selections(model: Glm5NextForConditionalGeneration) -> list:
    """Hooks recording each transformers indexer's top-k (int32 [B, T, K])."""
    seen: list = []
    for layer in model.model.language_model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.register_forward_hook(lambda m, i, o: seen.append(o))
    return seen


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same selected keys per query (order and -1 padding aside)."""
    def rows(t):
        return [sorted(x for x in row if x >= 0) for row in t.reshape(-1, t.shape[-1]).tolist()]
    return rows(a) == rows(b)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def ids_for(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next")
    transformers_model().save_pretrained(path)
    return path


def test_transformers_checkpoint_loads_and_gives_its_logits(reference_dir, caplog):
    ref = Glm5NextForConditionalGeneration.from_pretrained(reference_dir).eval()
    seen = selections(ref)
    with caplog.at_level(logging.WARNING, logger="glm5_core.model.checkpoint"):
        ours = load_pretrained(reference_dir).eval()
    assert any("skipped" in r.getMessage() and "vision" in r.getMessage() for r in caplog.records)
    cfg = ours.config
    assert cfg.is_hybrid and cfg.layer_kinds() == TEXT["layer_types"] and cfg.index_kpool == 4
    ids = ids_for()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids)
    assert len(seen) == len(got.topk_idx) == 1  # layer 1 runs the indexer, layer 2 shares its top-k
    for theirs, mine in zip(seen, got.topk_idx):
        assert mine.shape[-1] == cfg.index_topk + cfg.index_kpool - 1
        assert same_sets(mine, theirs)
    assert relative(got.logits, want) <= 1e-5


def test_our_checkpoint_loads_in_transformers_with_our_logits(tmp_path, reference_dir):
    cfg = load_pretrained(reference_dir).config
    ours = GLM5ForCausalLM(cfg).eval()
    ours.reset_parameters(seed=3)
    with torch.no_grad():  # the mHC and KDA parameters too (reset_parameters covers linears and norms)
        for name, p in ours.named_parameters():
            if name.endswith(("_hc.base", "_hc.scale", "A_log", "dt_bias", "conv1d.weight", "compress_ape")):
                p.add_(torch.randn_like(p) * 0.1)
    save_pretrained(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert written["text_config"]["layer_types"] == TEXT["layer_types"]
    ref = Glm5NextForConditionalGeneration.from_pretrained(tmp_path).eval()
    seen = selections(ref)
    ids = ids_for(seed=4)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids)
    for theirs, mine in zip(seen, got.topk_idx):
        assert same_sets(mine, theirs)
    assert relative(got.logits, want) <= 1e-5
    again = load_pretrained(tmp_path)  # and back: bit for bit
    for name, t in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_decode_from_the_cache_equals_the_prefill(reference_dir):
    """KDA layers decode from their recurrent + conv state, indexed layers from the latent cache and the pooled
    indexer keys: a prefill of 9 tokens then 14 decode steps give the logits of the 23-token prefill."""
    model = load_pretrained(reference_dir).eval().double()
    ids = ids_for(seed=5)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2, T)
        steps = [model(ids[:, :9], cache=cache, start_pos=0).logits]
        steps += [model(ids[:, t:t + 1], cache=cache, start_pos=t).logits for t in range(9, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)
    assert cache.kda[0] is not None and cache.kda[1] is None and cache.c_kv[0].shape[-1] == 0


def test_config_errors_are_one_line():
    base = GLM5Config.from_hf_dict({"model_type": "glm5_next", "text_config": dict(TEXT)})
    with pytest.raises(ValueError, match=r"^indexer_types\[1\]: expected 'full'") as err:
        base.replace(indexer_types=["full", "shared", "shared", "full"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^layer_types\[0\]: expected one of"):
        base.replace(layer_types=["mamba"] + TEXT["layer_types"][1:])
    with pytest.raises(ValueError, match=r"^index_topk: expected a multiple of index_kpool=3"):
        base.replace(index_kpool=3)
    with pytest.raises(ValueError, match=r"^hc_mult: expected 1 \(a glm5_next field"):
        GLM5Config.tiny(hc_mult=4)
    with pytest.raises(ValueError, match=r"^text_config.hidden_act: expected 'silu'"):
        GLM5Config.from_hf_dict({"model_type": "glm5_next", "text_config": dict(TEXT, hidden_act="gelu")})


# ---- GLM-5.3's published block-FP8 layout ----------------------------------------------------------------------
BLOCK = (8, 8)  # GLM-5.3 ships [128, 128]; 8 x 8 exercises partial edge blocks on the tiny shapes


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM block-FP8: per [8, 8] block, scale_inv = amax / 448 and weight / scale_inv in e4m3."""
    rows, cols = weight.shape
    br, bc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    padded = torch.zeros(br * BLOCK[0], bc * BLOCK[1])
    padded[:rows, :cols] = weight
    blocks = padded.view(br, BLOCK[0], bc, BLOCK[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [br, bc]
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(br * BLOCK[0], bc * BLOCK[1])
    return q[:rows, :cols].contiguous(), scale.float()


def _published_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' Glm5NextForConditionalGeneration names -> the original (published) flat layout that
    transformers' conversion_mapping.py ("glm5_next") renames on load: per-expert experts, separate q / k / v convs,
    forget-gate and mHC parameters under the layer's / attention's own names."""
    out = {}
    for name, t in state.items():
        if name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.")
        for new, old in ((".self_attn.forget_gate.", ".self_attn."), (".attn_hc.", ".hc_attn_"),
                         (".ffn_hc.", ".hc_ffn_")):
            name = name.replace(new, old)
        if name.endswith(".mlp.experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.clone()
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.clone()
        elif name.endswith(".mlp.experts.down_proj"):
            for e, w in enumerate(t):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = w.clone()
        elif name.endswith(".self_attn.conv1d.weight"):
            for part, w in zip("qkv", t.chunk(3, dim=0)):
                out[name.replace("conv1d", f"{part}_conv1d")] = w.clone()
        else:
            out[name] = t.clone()
    return out


def _write_fp8_checkpoint(path, ref, quantization_config) -> dict[str, torch.Tensor]:
    """Write ``ref``'s language model in the published block-FP8 layout; return transformers' state dict with
    the weights dequantized (what the checkpoint holds)."""
    from safetensors.torch import save_file

    state = {k: v.detach() for k, v in ref.state_dict().items()}
    published, dequantized = {}, dict(state)
    for name, t in _published_names(state).items():
        quantize = (name.startswith("model.layers.") and name.endswith("proj.weight") and t.dim() == 2
                    and ".mlp.gate." not in name)
        if quantize:
            q, scale = _quantize(t)
            published[name], published[name + "_scale_inv"] = q, scale
        else:
            published[name] = t.contiguous()
    for name, t in state.items():  # the same dequantization, written independently of glm5-core's
        if "visual" in name:
            continue
        flat = _published_names({name: t})
        if len(flat) == 1 and (key := next(iter(flat))) + "_scale_inv" in published:
            q, scale = published[key], published[key + "_scale_inv"]
            full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:q.shape[0], :q.shape[1]]
            dequantized[name] = q.float() * full
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = []
            for e in range(t.shape[0]):
                parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
                mats = []
                for part in parts:
                    key = name.replace("model.language_model.", "model.").rsplit(".", 1)[0] + f".{e}.{part}.weight"
                    q, scale = published[key], published[key + "_scale_inv"]
                    full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
                    mats.append(q.float() * full[:q.shape[0], :q.shape[1]])
                rows.append(torch.cat(mats, dim=0))
            dequantized[name] = torch.stack(rows)
    save_file(published, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(TEXT, model_type="glm5_next", architectures=["Glm5NextForConditionalGeneration"],
                  quantization_config=quantization_config)  # flat, as GLM-5.3-Flash's text-only config.json
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def test_block_fp8_checkpoint_is_dequantized_on_load(tmp_path):
    ref = transformers_model(seed=7)
    dequantized = _write_fp8_checkpoint(tmp_path, ref, FP8_CONFIG)
    ref.load_state_dict(dequantized)
    ours = load_pretrained(tmp_path).eval()
    assert ours.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.float32
    ids = ids_for(seed=8)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours(ids).logits
    assert relative(got, want) <= 1e-5


@pytest.mark.parametrize("change, match", [
    ({"quant_method": "awq"}, r"^quantization_config.quant_method: expected 'fp8' .*got 'awq'$"),
    ({"weight_block_size": [8, 0]}, r"^quantization_config.weight_block_size: expected"),
])
def test_other_quantization_is_refused_in_one_line(tmp_path, change, match):
    _write_fp8_checkpoint(tmp_path, transformers_model(seed=7), dict(FP8_CONFIG, **change))
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path)


def test_fp8_scale_of_the_wrong_shape_is_refused_before_reading(tmp_path):
    from safetensors.torch import load_file, save_file

    _write_fp8_checkpoint(tmp_path, transformers_model(seed=7), FP8_CONFIG)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
    tensors[name] = torch.ones(1, 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_a_proj.weight_scale_inv: expected float32 \[3, 4\]"):
        load_pretrained(tmp_path)


def test_kernelize_keeps_logits_and_greedy_generate(reference_dir, monkeypatch):
    """kernelize (glm5_core.integrations.transformers) on Glm5NextForConditionalGeneration's text path: the same
    logits (a prefill past index_topk) and the same greedy generation (KDA recurrent decode, pooled indexer keys
    in transformers' cache)."""
    from glm5_core.integrations.transformers import is_kernelized, kernelize

    ref = Glm5NextForConditionalGeneration.from_pretrained(reference_dir).eval()
    fast = kernelize(Glm5NextForConditionalGeneration.from_pretrained(reference_dir).eval(), backend="cpu")
    assert is_kernelized(fast) and not is_kernelized(ref)
    bound = {type(m).__name__ for m in fast.modules() if getattr(m, "glm5_backend", False) is not False}
    assert bound == {"Glm5NextTextAttention", "Glm5NextTextIndexer", "Glm5NextTextLinearAttention",
                     "Glm5NextTextHyperConnection", "Glm5NextTextTopkRouter", "Glm5NextTextExperts"}
    from glm5_core.ops import dsa, kda

    calls: dict[str, int] = {}
    def counting(op, name):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return op(*args, **kwargs)
        return counted

    for module, name in ((dsa, "sparse_prefill"), (dsa, "sparse_decode"), (kda, "chunked"), (kda, "recurrent"),
                         (dsa, "kpool_topk")):
        monkeypatch.setattr(module, name, counting(getattr(module, name), name))
    ids = ids_for(seed=9)
    with torch.no_grad():
        assert relative(fast(input_ids=ids).logits, ref(input_ids=ids).logits) <= 1e-5
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        want = ref.generate(ids[:, :14], **kw)
        got = fast.generate(ids[:, :14], **kw)
    assert torch.equal(got, want)
    # prefills: 1 logits call + 1 generate; decode steps: 5; two KDA and two indexed layers
    assert calls == {"sparse_prefill": 4, "chunked": 4, "sparse_decode": 10, "recurrent": 10, "kpool_topk": 7}


def test_clamped_swiglu_parity_where_the_clamp_acts(tmp_path):
    """swiglu_limit 0.05 clamps most gate / up values of the dense MLP, the shared and the routed experts: the
    logits still match transformers'."""
    ref = transformers_model(seed=11, swiglu_limit=0.05)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.config.swiglu_limit == 0.05
    ids = ids_for(seed=12)
    with torch.no_grad():
        assert relative(ours(ids).logits, ref(input_ids=ids).logits) <= 1e-5


def test_bf16_checkpoint_in_the_original_layout_loads(tmp_path, reference_dir):
    """transformers' bf16 save of GLM-5.3 writes the original (published) layout: hc_attn_* / q_conv1d / A_log names
    and fp32 for the modules it keeps in fp32 (the KDA conv and forget gate, the mHC biases, the router); it loads
    with those dtypes, and the same weights computed in fp32 on both sides give transformers' logits (bf16
    arithmetic itself differs: glm5-core keeps more of it in fp32)."""
    ref = Glm5NextForConditionalGeneration.from_pretrained(reference_dir, dtype=torch.bfloat16).eval()
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.model.layers[0].self_attn.conv1d.weight.dtype == torch.float32
    ours, ref = ours.float(), ref.float()
    ids = ids_for(seed=13)
    with torch.no_grad():
        assert relative(ours(ids).logits, ref(input_ids=ids).logits) <= 1e-5
