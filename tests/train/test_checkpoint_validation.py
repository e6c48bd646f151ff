"""Resuming from a mismatched or crafted checkpoint: a ValueError naming the tensor / key, expected and got,
raised while loading (not a RuntimeError or KeyError later inside the optimizer or the data reader)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm5_core.train import RunOptions, parse_config, pretrain
from glm5_core.train.checkpoint import resolve_checkpoint


@pytest.fixture
def run(small_raw, tmp_path):
    """A run stopped after 3 steps (dense 2 + 1 indexer warm-up): Muon and AdamW both hold state."""
    out = tmp_path / "run"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(out), max_steps=3))
    return out


def _resume(small_raw, run):
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run.parent / "resumed"),
                                                 resume=str(run)))


def _rewrite_optimizer(run, edit):
    path = resolve_checkpoint(Path(run)) / "optimizer.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        groups = json.loads(f.metadata()["param_groups"])
    edit(tensors, groups)
    save_file(tensors, str(path), metadata={"param_groups": json.dumps(groups)})


def _first(tensors, part, key):
    return min((k for k in tensors if k.startswith(f"{part}/") and k.endswith(f"/{key}")),
               key=lambda k: int(k.split("/")[1]))


def _set(part, key, transform):
    def edit(tensors, groups):
        name = _first(tensors, part, key)
        tensors[name] = transform(tensors[name])
    return edit


def _drop(part, key):
    def edit(tensors, groups):
        del tensors[_first(tensors, part, key)]
    return edit


def _set_group(part, key, value):
    def edit(tensors, groups):
        groups[part][0][key] = value(groups[part][0][key])
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set("adamw", "exp_avg", lambda t: t.reshape(-1)[:-1].clone()),
     r"optimizer state of model\.\S+ \(adamw\) exp_avg: expected torch.float32 of shape \([\d, ]+\), got "
     r"torch.float32 of shape \(\d+,\)"),
    (_set("muon", "momentum_buffer", lambda t: t.double()),
     r"optimizer state of model\.\S+ \(muon\) momentum_buffer: expected torch.float32 of shape \(\d+, \d+\), "
     r"got torch.float64"),
    (_set("adamw", "step", lambda t: torch.stack([t, t])),
     r"\(adamw\) step: expected a finite scalar >= 0, got torch.float32 of shape \(2,\)"),
    (_set("adamw", "step", lambda t: torch.full_like(t, -1.0)), r"step: expected a finite scalar >= 0, .* = -1.0"),
    (_drop("adamw", "exp_avg_sq"),
     r"\(adamw\): expected keys \['exp_avg', 'exp_avg_sq', 'step'\], got \['exp_avg', 'step'\]"),
    (_set_group("muon", "params", lambda ids: ids[::-1]), r"part 'muon' group 0 params: expected \[0, 1"),
    (_set_group("adamw", "role", lambda role: "indexer" if role == "main" else "main"), r"part 'adamw' group 0 role"),
    (_set_group("adamw", "weight_decay", lambda wd: "0.1"), r"group 0 weight_decay: expected a finite number"),
    (_set_group("adamw", "eps", lambda eps: float("nan")), r"group 0 eps: expected a finite number .*, got nan"),
])
def test_bad_optimizer_state_is_named_at_load(small_raw, run, edit, message):
    _rewrite_optimizer(run, edit)
    with pytest.raises(ValueError, match=message):
        _resume(small_raw, run)


def test_untouched_checkpoint_resumes(small_raw, run):
    _rewrite_optimizer(run, lambda tensors, groups: None)  # the rewrite itself keeps a valid file valid
    _resume(small_raw, run)
    assert (run.parent / "resumed" / "checkpoints" / "latest").is_file()


def test_model_file_dtype_mismatch_is_named_before_loading(small_raw, run):
    path = resolve_checkpoint(Path(run)) / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].double()
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"model tensors do not match this model \(model.norm.weight: expected "
                                         r"torch.float32 of shape \(32,\), got torch.float64 of shape \(32,\)\)"):
        _resume(small_raw, run)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("offset"), r"data position: expected keys \['epoch', 'doc', 'offset'\], missing \['offset'\]"),
    (lambda d: d.update(extra=1), r"unexpected \['extra'\]"),
    (lambda d: d.update(doc=True), r"data position doc: expected an int >= 0, got True"),
    (lambda d: d.update(epoch=-1), r"data position epoch: expected an int >= 0, got -1"),
    (lambda d: d.update(offset=10 ** 6), r"data position offset: expected < \d+ \(the tokens of document \d+\), "
                                         r"got 1000000"),
])
def test_bad_data_position_is_named_at_load(small_raw, run, change, message):
    path = resolve_checkpoint(Path(run)) / "trainer_state.json"
    state = json.loads(path.read_text())
    change(state["data"])
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=message):
        _resume(small_raw, run)
