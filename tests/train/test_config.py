"""Bad config values give one clear line each, naming the key path, what was expected and what came."""
import pytest
import yaml

from glm5_core.cli import main
from glm5_core.train import ConfigError, load_config, parse_config


def _problems(raw):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return info.value.problems


@pytest.mark.parametrize("path", ["configs/tiny.yaml", "configs/small.yaml", "configs/tiny_glm53.yaml"])
def test_the_shipped_configs_parse(path, monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(64 << 30))  # small.yaml is for an accelerator node
    cfg = load_config(path)
    assert [s.kind for s in cfg.stages] == ["dense", "indexer_warmup", "sparse"]
    assert cfg.model_config().num_attention_heads >= 1


@pytest.mark.parametrize("patch,expected", [
    ({"optimizer": {"lr": 1e-3}}, "optimizer.lr: unknown key"),
    ({"schedul": {}}, "schedul: unknown key; did you mean 'schedule'?"),
    ({"data": {"seq_lenn": 12}}, "data.seq_lenn: unknown key; did you mean 'seq_len'?"),
    ({"data": {"seq_len": 0}}, "data.seq_len: expected an integer in [1, inf), got 0"),
    ({"data": {"batch_size": "eight"}}, "data.batch_size: expected an integer in [1, inf), got 'eight'"),
    ({"data": {"source": "stdlb"}},
     "data.source: expected one of 'stdlib', 'path', got 'stdlb'; did you mean 'stdlib'?"),
    ({"schedule": {"min_lr_ratio": 1.5}}, "schedule.min_lr_ratio: expected a number in [0, 1], got 1.5"),
    ({"schedule": {"lr": "fast"}}, "schedule.lr: expected a finite number in (0, inf), got 'fast'"),
    ({"optimizer": {"muon": {"momentum": 1.0}}}, "optimizer.muon.momentum: expected a number in [0, 1), got 1.0"),
    ({"optimizer": {"muon": {"scale_mode": "rms"}}}, "optimizer.muon.scale_mode: expected one of"),
    ({"optimizer": {"muon": {"ns_dtype": "bf16"}}},
     "optimizer.muon.ns_dtype: expected one of 'float32', 'bfloat16', 'auto', got 'bf16'; did you mean 'bfloat16'?"),
    ({"optimizer": {"muon": {"ns_dtype": 16}}}, "optimizer.muon.ns_dtype: expected one of"),
    ({"optimizer": {"muon": {"nesterov": "yes"}}}, "optimizer.muon.nesterov: expected true or false, got 'yes'"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected a list of 2 values, got 1"),
    ({"optimizer": {"betas": [0.9, 1.5]}}, "optimizer.betas: expected two values in [0, 1), got [0.9, 1.5]"),
    ({"stages": [{"kind": "dens", "steps": 3}]},
     "stages[0].kind: expected one of 'dense', 'indexer_warmup', 'sparse', got 'dens'"),
    ({"stages": [{"kind": "dense", "steps": -1}]}, "stages[0].steps: expected an integer in [1, inf), got -1"),
    ({"stages": [{"kind": "indexer_warmup", "steps": 2}]}, "stages[0].indexer_lr: an indexer_warmup stage needs"),
    ({"stages": [{"kind": "dense", "steps": 2, "indexer_lr": 1e-3, "indexer_final_lr": 1e-4}]},
     "stages[0].indexer_lr: a dense stage does not train the indexer"),
    ({"stages": []}, "stages: expected at least one stage"),
    ({"model": {"preset": "tiny", "hiden_size": 64}}, "model.hiden_size: unknown key; did you mean 'hidden_size'?"),
    ({"model": {"preset": "tiny", "num_attention_heads": 0}},
     "model.num_attention_heads: expected an integer in [1, 16777216], got 0"),
    ({"model": {"preset": "huge"}}, "model.preset: expected one of tiny, tiny_glm53, got 'huge'"),
    ({"data": {"source": "path"}}, "data.path: expected a file or folder when data.source is 'path'"),
    ({"data": {"eos_token": "</s>"}}, "data.eos_token: only read with an HF tokenizer.json"),
    ({"loss": {"mtp_weight": -0.1}}, "loss.mtp_weight: expected a number in [0, inf), got -0.1"),
    ({"data": {"seq_len": 4096}, "model": {"preset": "tiny", "max_position_embeddings": 512}},
     "data.seq_len: expected <= model.max_position_embeddings (512), got 4096"),
    ({"loss": {"mtp_depths": 2}, "model": {"preset": "tiny", "num_nextn_predict_layers": 0}},
     "loss.mtp_depths: expected 0 when model.num_nextn_predict_layers is 0, got 2"),
])
def test_each_bad_value_is_one_clear_line(patch, expected):
    problems = _problems(patch)
    assert len(problems) == 1, problems
    assert "\n" not in problems[0]
    assert problems[0].startswith(expected), problems[0]


def test_an_indexer_lr_in_a_dense_stage_names_the_kind_too():
    """The config fuzz turned configs/tiny.yaml's indexer_warmup stage dense: the line must name the key it changed."""
    stage = {"kind": "dense", "steps": 2, "indexer_lr": 1e-3, "indexer_final_lr": 1e-4}
    assert _problems({"stages": [{"kind": "dense", "steps": 1}, stage]}) == [
        "stages[1].indexer_lr: a dense stage does not train the indexer; remove it (or set stages[1].kind to "
        "indexer_warmup or sparse)"]


def test_several_problems_are_all_reported_one_per_line():
    problems = _problems({"data": {"seq_len": -4, "batch_size": 0, "colour": "red"}})
    assert len(problems) == 3
    assert any(p.startswith("data.seq_len:") for p in problems)
    assert any(p.startswith("data.batch_size:") for p in problems)
    assert any(p.startswith("data.colour: unknown key") for p in problems)


def test_yaml_exponents_without_a_dot_are_numbers():
    cfg = parse_config(yaml.safe_load("schedule: {lr: 5e-3}"))
    assert cfg.schedule.lr == 5e-3


def test_cli_prints_the_problems_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("data: {seq_len: 0}\nschedule: {warmup_step: 3}\n")
    assert main(["pretrain", "--config", str(path), "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "data.seq_len: expected an integer in [1, inf), got 0" in err
    assert "schedule.warmup_step: unknown key; did you mean 'warmup_steps'?" in err


def test_missing_config_file_is_named(tmp_path, capsys):
    assert main(["pretrain", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "--config: no such file" in capsys.readouterr().err


def test_a_vocabulary_smaller_than_the_tokenizer_is_named(tmp_path):
    from glm5_core.train import RunOptions, pretrain

    cfg = parse_config({"model": {"preset": "tiny", "vocab_size": 100}, "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"model.vocab_size: expected >= the tokenizer's vocabulary \(257\), got 100"):
        pretrain(cfg, RunOptions(backend="cpu"))
