"""A checkpoint's optimizer hyper-parameters replace the run's at load (``load_state_dict``), so a crafted or
corrupted file must meet the ranges the optimizers' constructors enforce: refused at load with a ValueError
naming the part, group and key, never trained with (momentum 1.5, betas >= 1 and a negative weight decay
trained on silently; ns_steps 0 failed only inside the next step)."""
import json
from pathlib import Path

import pytest
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


def _set_group_value(run: Path, part: str, key: str, value) -> None:
    path = resolve_checkpoint(run) / "optimizer.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        groups = json.loads(f.metadata()["param_groups"])
    groups[part][-1][key] = value
    save_file(tensors, str(path), metadata={"param_groups": json.dumps(groups)})


def _resume(small_raw, run: Path) -> None:
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run.parent / "resumed"),
                                                 resume=str(run)))


@pytest.mark.parametrize("part, key, value, message", [
    ("muon", "momentum", 1.5, r"part 'muon' group \d momentum: expected a number in \[0.0, 1.0\), got 1.5"),
    ("muon", "weight_decay", -0.5, r"part 'muon' group \d weight_decay: expected a number in \[0.0, inf\], got -0.5"),
    ("muon", "ns_steps", 0, r"part 'muon' group \d ns_steps"),
    ("muon", "scale_mode", "bogus", r"part 'muon' group \d scale_mode: expected one of"),
    ("muon", "ns_dtype", "float16", r"part 'muon' group \d ns_dtype: expected torch.float32, torch.bfloat16"),
    ("adamw", "betas", [1.5, 0.9], r"part 'adamw' group \d betas: expected two numbers in \[0, 1\), got \[1.5, 0.9\]"),
    ("adamw", "betas", [0.9], r"part 'adamw' group \d betas: expected two numbers"),
    ("adamw", "weight_decay", -3.0, r"part 'adamw' group \d weight_decay: expected a number >= 0, got -3.0"),
    ("adamw", "eps", -1e-8, r"part 'adamw' group \d eps: expected a number >= 0"),
])
def test_out_of_range_hyperparameters_are_refused_at_load(small_raw, run, part, key, value, message):
    _set_group_value(run, part, key, value)
    with pytest.raises(ValueError, match=message):
        _resume(small_raw, run)
    assert not (run.parent / "resumed" / "checkpoints").exists()  # refused before any step


def test_in_range_hyperparameters_load_and_the_config_wins(small_raw, run, capsys):
    """A valid saved value (momentum 0.5 instead of the run's 0.95) loads without error; the config's value
    replaces it (as the schedule's lr does) and the resume says so."""
    from glm5_core.train.trainer import PretrainTrainer

    _set_group_value(run, "muon", "momentum", 0.5)
    trainer = PretrainTrainer(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run.parent / "resumed"),
                                                          resume=str(run)))
    muon = trainer.optimizer.optimizers["muon"]
    assert [g["momentum"] for g in muon.param_groups][-1] == 0.95
    assert "momentum: 0.5 -> 0.95" in capsys.readouterr().err


def test_a_checkpoint_from_before_ns_dtype_loads_as_float32(small_raw, run, capsys):
    """Checkpoints written before the Newton-Schulz compute dtype existed have no ``ns_dtype`` in their Muon
    groups: they ran fp32, and load as such (the config's value then wins, as for every key)."""
    from glm5_core.train.trainer import PretrainTrainer

    path = resolve_checkpoint(run) / "optimizer.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        groups = json.loads(f.metadata()["param_groups"])
    for group in groups["muon"]:
        del group["ns_dtype"]
    save_file(tensors, str(path), metadata={"param_groups": json.dumps(groups)})
    raw = {**small_raw, "optimizer": {**small_raw.get("optimizer", {}), "muon": {"ns_dtype": "bfloat16"}}}
    trainer = PretrainTrainer(parse_config(raw), RunOptions(backend="cpu", output_dir=str(run.parent / "resumed"),
                                                    resume=str(run)))
    assert {g["ns_dtype"] for g in trainer.optimizer.optimizers["muon"].param_groups} == {"bfloat16"}
    assert "ns_dtype: 'float32' -> 'bfloat16'" in capsys.readouterr().err
