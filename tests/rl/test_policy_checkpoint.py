"""`glm5 rl --checkpoint <pretrain checkpoint folder>`: the policy loads model.safetensors, tied embeddings
included (the file holds one name of a tied pair), and a file that does not fit the preset is refused."""
import pytest
import torch
from safetensors.torch import save_model

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.policy import build_policy


def _config(tmp_path, **overrides):
    return config_from_dict({"output_dir": str(tmp_path / "rl"),
                             "model": {"preset": "tiny", "overrides": {"index_topk": 8, **overrides}}})


@pytest.mark.parametrize("tied", [False, True])
def test_the_policy_loads_a_pretrain_checkpoint(tmp_path, tied):
    torch.manual_seed(11)
    source = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, tie_word_embeddings=tied))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_model(source, str(folder / "model.safetensors"))  # drops one name of each tied group
    policy = build_policy(_config(tmp_path, tie_word_embeddings=tied), str(folder), None)
    for (name, want), got in zip(source.state_dict().items(), policy.state_dict().values()):
        assert torch.equal(want, got), name
    if tied:
        assert policy.lm_head.weight is policy.model.embed_tokens.weight


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_model(GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, hidden_size=96)), str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="do not fit model.preset"):
        build_policy(_config(tmp_path), str(folder), None)
