"""Tied weights (``tie_word_embeddings``) in training checkpoints, unsharded and under FSDP2.

A checkpoint stores a tied group once, under its sorted-first name (``lm_head.weight``, the name
``safetensors.torch.save_model`` keeps), whatever the strategy; loading fills every tied name from it. The
FSDP2 cases shard the model over a one-rank gloo group in this process: its parameters are DTensors, so
saving gathers them and loading takes the sharded-loader path, as on many ranks.
"""
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.optim import OptimizerConfig, build_optimizer
from glm5_core.train.checkpoint import load_checkpoint, save_checkpoint
from glm5_core.train.fsdp import full_state_dict, is_dtensor, shard_model, tied_groups
from tests.train.small_run import small_model_kwargs

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


MODEL = small_model_kwargs()


@pytest.fixture
def one_rank_group(tmp_path):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int, *, tie: bool = True, sharded: bool = False) -> GLM5ForCausalLM:
    model = GLM5ForCausalLM(GLM5Config.tiny(**MODEL, tie_word_embeddings=tie))
    model.reset_parameters(seed=seed)
    if sharded:
        shard_model(model, "cpu", 1)
    return model


def _optimizer(model):
    return build_optimizer(model, OptimizerConfig(), num_heads=MODEL["num_attention_heads"], lr=1e-2)


def _save(root: Path, model) -> Path:
    return save_checkpoint(root, step=1, model=model, optimizer=_optimizer(model), data_state={}, world_size=1,
                           device_type="cpu", keep_last=1) / "model.safetensors"


def _load(path: Path, model) -> None:
    load_checkpoint(path.parent, model=model, optimizer=_optimizer(model), total_steps=1, world_size=1,
                    device_type="cpu")


def _names(path: Path):
    with safe_open(str(path), framework="pt") as f:
        return sorted(f.keys())


def _assert_same_weights(model, source, *, tied: bool = True) -> None:
    got, want = full_state_dict(model), full_state_dict(source)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert torch.equal(got[HEAD], got[EMBED]) == tied


def test_tied_groups_come_from_the_parameters_themselves():
    assert tied_groups(_model(1)) == [[EMBED, HEAD]]
    assert tied_groups(_model(1, tie=False)) == []


def test_unsharded_tied_checkpoint_stores_one_name_and_round_trips(tmp_path):
    source = _model(1)
    path = _save(tmp_path / "a", source)
    assert _names(path) == sorted(set(source.state_dict()) - {EMBED})
    target = _model(2)
    _load(path, target)
    _assert_same_weights(target, source)
    assert target.lm_head.weight is target.model.embed_tokens.weight  # still one parameter


def test_untied_checkpoint_stores_every_name(tmp_path):
    source = _model(1, tie=False)
    path = _save(tmp_path / "a", source)
    assert _names(path) == sorted(source.state_dict())
    target = _model(2, tie=False)
    _load(path, target)
    _assert_same_weights(target, source, tied=False)


def test_sharded_tied_checkpoint_has_the_unsharded_format_and_loads_both_ways(tmp_path, one_rank_group):
    plain_path = _save(tmp_path / "plain", _model(1))
    sharded = _model(1, sharded=True)
    assert is_dtensor(sharded.lm_head.weight) and tied_groups(sharded) == [[EMBED, HEAD]]
    sharded_path = _save(tmp_path / "sharded", sharded)
    plain_file, sharded_file = load_file(str(plain_path)), load_file(str(sharded_path))
    assert sorted(sharded_file) == sorted(plain_file) and HEAD in sharded_file and EMBED not in sharded_file
    assert all(torch.equal(sharded_file[k], plain_file[k]) for k in plain_file)

    into_sharded = _model(2, sharded=True)  # a single-name file into the sharded loader
    _load(plain_path, into_sharded)
    _assert_same_weights(into_sharded, sharded)
    into_plain = _model(2)  # the sharded run's file into an unsharded model
    _load(sharded_path, into_plain)
    _assert_same_weights(into_plain, sharded)


def test_both_tied_names_load_when_equal_and_are_refused_when_not(tmp_path):
    source = _model(1)
    path = _save(tmp_path / "a", source)
    tensors = load_file(str(path))
    tensors[EMBED] = tensors[HEAD].clone()  # as the previous sharded save wrote it
    save_file(tensors, str(path))
    target = _model(2)
    _load(path, target)
    _assert_same_weights(target, source)
    tensors[EMBED][0, 0] += 1.0
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"model tensors '{HEAD}' and '{EMBED}' are tied in this model but differ"):
        _load(path, _model(2))


def test_missing_tied_group_is_named(tmp_path):
    path = _save(tmp_path / "a", _model(1))
    tensors = load_file(str(path))
    del tensors[HEAD]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"model tensors do not match this model \(missing \['{HEAD}'\], "
                                         rf"unexpected \[\]\)"):
        _load(path, _model(2))
