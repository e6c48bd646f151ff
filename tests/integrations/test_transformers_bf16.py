"""bf16 in both directions, judged against transformers' own bf16 error: glm5-core in bf16 is at most twice
as far from transformers' fp32 logits as transformers in bf16 is (plus 2e-3), on the fp32 tests' models
(full and shared indexer layers, sequences longer than index_topk)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from transformers import AutoModelForCausalLM  # noqa: E402

from glm5_core.model import load_pretrained, save_pretrained  # noqa: E402
from tests.integrations.hf_models import glm5_model, hf_config, hf_model, median_position_err, token_ids  # noqa: E402

SLACK = 2e-3
INDEXER_LAYOUTS = {"full": ["full"] * 4, "shared": ["full", "shared", "full", "shared"]}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _hf(path, dtype):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@pytest.mark.parametrize("layout", sorted(INDEXER_LAYOUTS))
def test_bf16_checkpoint_from_transformers(tmp_path, layout):
    """transformers' bf16 checkpoint (whose router weights it keeps in fp32) loads as a bf16 model that keeps
    each tensor's dtype."""
    hf = hf_model(hf_config(indexer_types=INDEXER_LAYOUTS[layout]))
    hf.save_pretrained(tmp_path / "fp32")
    hf_bf16 = _hf(tmp_path / "fp32", torch.bfloat16)
    hf_bf16.save_pretrained(tmp_path / "bf16")
    ours = load_pretrained(tmp_path / "bf16").eval()
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    router_dtype = hf_bf16.model.layers[1].mlp.gate.weight.dtype  # fp32 in transformers 5.24
    assert all(m.gate.weight.dtype == router_dtype for m in ours.moe_layers())
    ids = token_ids(hf.config.vocab_size)
    want = _logits(hf, ids)
    hf_err, our_err = median_position_err(_logits(hf_bf16, ids), want), median_position_err(_logits(ours, ids), want)
    assert 0 < our_err <= 2 * hf_err + SLACK, (our_err, hf_err)


@pytest.mark.parametrize("layout", sorted(INDEXER_LAYOUTS))
def test_bf16_export_to_transformers(tmp_path, layout):
    ours = glm5_model(num_nextn_predict_layers=0, indexer_types=INDEXER_LAYOUTS[layout]).to(torch.bfloat16)
    save_pretrained(ours, tmp_path)
    ids = token_ids(ours.config.vocab_size)
    want = _logits(_hf(tmp_path, torch.float32), ids)  # transformers in fp32 on the (bf16-valued) weights
    hf_err = median_position_err(_logits(_hf(tmp_path, torch.bfloat16), ids), want)
    our_err = median_position_err(_logits(ours, ids), want)
    assert 0 < our_err <= 2 * hf_err + SLACK, (our_err, hf_err)
