"""Config combinations transformers accepts (GlmMoeDsaConfig validates them, the model builds and
``save_pretrained`` writes it) that glm5-core refuses: ``load_pretrained`` raises one ValueError, one line,
starting with the key. Some of them transformers even runs (to another function than glm5-core computes),
most others fail only inside its forward."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from glm5_core.model import load_pretrained  # noqa: E402
from tests.integrations.hf_models import hf_config, hf_model  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 2.0, "original_max_position_embeddings": 64}
# (key the error starts with, config overrides, whether transformers' forward runs with it in every tested
# version: 5.17 also runs the layer_types one, 5.24 does not)
REFUSED = [
    ("mlp_layer_types", dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]), True),
    ("attention_dropout", dict(attention_dropout=0.1), True),
    ("rope_parameters.rope_type", dict(rope_parameters=YARN), True),
    ("hidden_act", dict(hidden_act="gelu"), True),
    ("attention_bias", dict(attention_bias=True), True),
    ("num_key_value_heads", dict(num_key_value_heads=1), False),
    ("layer_types", dict(layer_types=["full_attention"] * 4), False),
    ("indexer_types[0]", dict(indexer_types=["shared", "full", "full", "full"]), False),
    ("topk_group", dict(n_group=2, topk_group=3), False),
    ("n_group", dict(n_group=4), False),
    ("num_experts_per_tok", dict(num_experts_per_tok=7), False),
    ("index_head_dim", dict(index_head_dim=2), False),
]


def _runs(model) -> bool:
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, dtype=torch.long))
        return True
    except (RuntimeError, ValueError):
        return False


@pytest.mark.parametrize("key, overrides, transformers_runs", REFUSED, ids=[r[0] for r in REFUSED])
def test_config_transformers_accepts_is_refused_in_one_line(tmp_path, key, overrides, transformers_runs):
    model = hf_model(hf_config(**overrides))  # transformers' config validation passes
    model.save_pretrained(tmp_path)
    if transformers_runs:
        assert _runs(model)
    with pytest.raises(ValueError) as info:
        load_pretrained(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{key}: ") and "\n" not in message, message
