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
