"""transformers -> glm5-core: every directory ``GlmMoeDsaForCausalLM.save_pretrained`` writes loads with
``glm5_core.model.load_pretrained``, and the loaded model called as ``model(input_ids)`` computes what
transformers computes (DSA sparse attention with the checkpoint's index_topk and indexer_types), fp32."""
from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from glm5_core.model import load_pretrained  # noqa: E402
from tests.integrations.hf_models import SEQ_LEN, hf_config, hf_model, rel_err, token_ids  # noqa: E402

FP32_RTOL = 1e-5
INDEXER_LAYOUTS = {"full": ["full"] * 4, "shared": ["full", "shared", "full", "shared"]}


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("layout", sorted(INDEXER_LAYOUTS))
def test_loaded_model_computes_transformers_logits(tmp_path, layout):
    hf = hf_model(hf_config(indexer_types=INDEXER_LAYOUTS[layout]))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.config.index_topk == 8 < SEQ_LEN and ours.config.layer_indexer_types() == INDEXER_LAYOUTS[layout]
    ids = token_ids(hf.config.vocab_size)
    assert rel_err(_logits(ours, ids), _logits(hf, ids)) < FP32_RTOL


def test_default_config_declares_mtp_the_shards_lack(tmp_path, caplog):
    """transformers' default config (num_nextn_predict_layers: 1, as GLM-5's) stores no MTP weights: the
    main model loads, one line says the MTP module is absent, and asking for MTP depths is a ValueError."""
    hf = hf_model(hf_config(num_nextn_predict_layers=1))
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("num_nextn_predict_layers", 1) == 1
    with caplog.at_level(logging.INFO):
        ours = load_pretrained(tmp_path).eval()
    lines = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "model.layers.4" in lines[0], lines
    assert ours.model.mtp is None
    ids = token_ids(hf.config.vocab_size)
    assert rel_err(_logits(ours, ids), _logits(hf, ids)) < FP32_RTOL
    with pytest.raises(ValueError, match=r"^mtp_depths: .*MTP"):
        ours(ids, mtp_depths=1)


def test_fused_expert_layout_loads(tmp_path):
    """``save_pretrained(save_original_format=False)`` writes transformers' in-memory layout: one
    ``experts.gate_up_proj`` [E, 2F, D] and one ``experts.down_proj`` [E, D, F] per MoE layer."""
    hf = hf_model(hf_config())
    hf.save_pretrained(tmp_path, save_original_format=False)
    index = tmp_path / "model.safetensors.index.json"
    names = json.loads(index.read_text())["weight_map"] if index.exists() else _single_file_names(tmp_path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    ours = load_pretrained(tmp_path).eval()
    ids = token_ids(hf.config.vocab_size)
    assert rel_err(_logits(ours, ids), _logits(hf, ids)) < FP32_RTOL


def _single_file_names(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_dense_attention_stays_available(tmp_path):
    """The dense mode (first pretraining stage) is an explicit argument: past index_topk it differs from
    the checkpoint's DSA; with index_topk covering every key both modes compute transformers' logits."""
    hf = hf_model(hf_config())
    hf.save_pretrained(tmp_path / "sparse")
    ours = load_pretrained(tmp_path / "sparse").eval()
    ids = token_ids(hf.config.vocab_size)
    assert rel_err(_logits(ours, ids, attention="dense"), _logits(ours, ids)) > 1e-3

    wide = hf_model(hf_config(index_topk=SEQ_LEN))
    wide.save_pretrained(tmp_path / "wide")
    ours = load_pretrained(tmp_path / "wide").eval()
    for attention in ("dense", "sparse"):
        assert rel_err(_logits(ours, ids, attention=attention), _logits(wide, ids)) < FP32_RTOL, attention


def test_tied_embeddings_load(tmp_path):
    hf = hf_model(hf_config(tie_word_embeddings=True))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = token_ids(hf.config.vocab_size)
    assert rel_err(_logits(ours, ids), _logits(hf, ids)) < FP32_RTOL


def test_no_shared_experts_loads(tmp_path):
    """With n_shared_experts 0 transformers stores zero-width shared-expert weights; glm5-core has none."""
    hf = hf_model(hf_config(n_shared_experts=0))
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.model.layers[1].mlp.shared_experts is None
    ids = token_ids(hf.config.vocab_size)
    assert rel_err(_logits(ours, ids), _logits(hf, ids)) < FP32_RTOL
