"""A run resumed from a checkpoint repeats the uninterrupted run bitwise; each stage trains what it should."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm5_core.cli import main
from glm5_core.train import RunOptions, parse_config, pretrain
from glm5_core.train.checkpoint import resolve_checkpoint
from glm5_core.train.trainer import PretrainTrainer

NON_DETERMINISTIC = {"tokens_per_s"}


def _records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in NON_DETERMINISTIC} for line in lines]


def _model_at(run_dir, step):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))


def test_resume_is_bitwise(small_raw, tmp_path):
    cfg = parse_config(small_raw)
    full, split = tmp_path / "full", tmp_path / "split"
    pretrain(cfg, RunOptions(backend="cpu", output_dir=str(full)))
    # Stop inside the indexer warm-up (step 3 of 6), then resume through the stage changes to the end.
    pretrain(cfg, RunOptions(backend="cpu", output_dir=str(split), max_steps=3))
    assert len(_records(split)) == 3
    pretrain(cfg, RunOptions(backend="cpu", output_dir=str(split), resume=str(split)))
    a, b = _records(full), _records(split)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert a == b  # every loss, KL, recall, grad norm, lr and load figure, compared exactly
    final_a, final_b = _model_at(full, 6), _model_at(split, 6)
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_stages_train_what_they_should(small_raw, tmp_path):
    small_raw["checkpoint"] = {"every_steps": 2, "keep_last": 10}
    run = tmp_path / "run"
    summary = pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run)))
    assert summary["stages"] == ["dense", "indexer_warmup", "sparse"]
    init = _model_at(run, 2)  # after dense
    warm = _model_at(run, 4)  # after indexer warm-up
    done = _model_at(run, 6)  # after sparse

    def is_indexer(k):
        return ".indexer." in k

    def is_router_bias(k):
        return k.endswith("e_score_correction_bias")

    changed_in_warmup = {k for k in init if not torch.equal(init[k], warm[k])}
    assert changed_in_warmup and all(is_indexer(k) for k in changed_in_warmup), sorted(changed_in_warmup)
    changed_in_sparse = {k for k in warm if not torch.equal(warm[k], done[k])}
    assert any(is_indexer(k) for k in changed_in_sparse)
    assert any(is_router_bias(k) for k in changed_in_sparse)
    assert "lm_head.weight" in changed_in_sparse and "model.embed_tokens.weight" in changed_in_sparse
    records = _records(run)
    assert [r["stage"] for r in records] == ["dense"] * 2 + ["indexer_warmup"] * 2 + ["sparse"] * 2
    assert all(r.get("lm_loss") is None and r["indexer_kl"] >= 0 for r in records[2:4])
    assert all(r["lm_loss"] > 0 and r["mtp_loss"] > 0 and 0 <= r["topk_recall"] <= 1 for r in records[4:])
    assert records[2]["indexer_lr"] == pytest.approx(5e-3) and records[3]["indexer_lr"] == pytest.approx(2e-4)


def test_each_step_reports_the_ops_that_ran_the_reference(small_raw, tmp_path):
    """A sparse step trains on kernels only (the indexer top-k and the sparse attention with its backward), a dense
    step too (its attention: ``mla_prefill`` through torch's fused CPU sdpa), but for the recall metric's full indexer
    scores, which the cpu backend leaves to the reference, saying why."""
    from glm5_core.backends.cpu import backend

    if not backend.status().built:
        pytest.skip(f"every op runs the reference here: {backend.status().describe()}")
    run = tmp_path / "run"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run)))
    records = _records(run)
    assert [r["stage"] for r in records][4:] == ["sparse"] * 2
    assert all(r["reference_ops"] == {} for r in records[4:]), [r["reference_ops"] for r in records[4:]]
    dense = records[0]["reference_ops"]  # the recall metric's full indexer scores only
    assert set(dense) <= {"dsa_indexer_scores"}, dense
    assert all("no native kernel" in why for whys in dense.values() for why in whys)


def test_dense_stage_leaves_the_indexer_alone(small_raw, tmp_path):
    small_raw["stages"] = [{"kind": "dense", "steps": 2}]
    small_raw["checkpoint"] = {"every_steps": 1, "keep_last": 10}
    run = tmp_path / "run"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run)))
    first, second = _model_at(run, 1), _model_at(run, 2)
    for k in first:
        assert torch.equal(first[k], second[k]) == (".indexer." in k), k


def test_checkpoints_are_complete_and_old_ones_pruned(small_raw, tmp_path):
    small_raw["checkpoint"] = {"every_steps": 1, "keep_last": 2}
    run = tmp_path / "run"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run), max_steps=4))
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    latest = resolve_checkpoint(run)
    assert latest.name == "step_00000004"
    assert sorted(p.name for p in latest.iterdir()) == ["model.safetensors", "optimizer.safetensors",
                                                         "rng.safetensors", "trainer_state.json"]


def test_resume_rejects_a_checkpoint_of_another_model(small_raw, tmp_path):
    run = tmp_path / "run"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run), max_steps=1))
    small_raw["model"]["hidden_size"] = 48
    with pytest.raises(ValueError, match="checkpoint: model tensors do not match"):
        pretrain(parse_config(small_raw),
                 RunOptions(backend="cpu", output_dir=str(tmp_path / "other"), resume=str(run)))


def test_cli_runs_and_resumes(small_raw, tmp_path, capsys):
    import yaml

    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small_raw))
    out = tmp_path / "cli"
    assert main(["pretrain", "--config", str(path), "--backend", "cpu", "--output-dir", str(out),
                 "--max-steps", "5"]) == 0
    assert main(["pretrain", "--config", str(path), "--backend", "cpu", "--output-dir", str(out), "--resume"]) == 0
    assert "stages: dense, indexer_warmup, sparse" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == [5, 6]


def test_run_ends_with_an_hf_layout_export_of_its_weights(small_raw, tmp_path):
    from glm5_core.model import load_pretrained
    from glm5_core.model.hf_layout import to_transformers_form

    run = tmp_path / "run"
    summary = pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run), max_steps=2))
    assert summary["hf_checkpoint"] == str(run / "final")
    exported = load_pretrained(run / "final").state_dict()
    trained = _model_at(run, 2)
    assert exported.keys() == trained.keys()  # HF parameter names, router biases included
    _, want = to_transformers_form(parse_config(small_raw).model_config(), trained)  # as transformers computes
    assert all(torch.equal(exported[k], want[k]) for k in trained)


def test_resuming_at_the_last_step_trains_nothing_and_says_so(small_raw, tmp_path, capsys):
    """--resume of a finished run (or at --max-steps) ran no step: the CLI reports that instead of failing to
    format a missing tokens/s; a --max-steps below the checkpoint's step is named."""
    import yaml

    path = tmp_path / "small.yaml"
    small_raw["stages"] = [dict(kind="dense", steps=2)]
    path.write_text(yaml.safe_dump(small_raw))
    out = tmp_path / "cli"
    args = ["pretrain", "--config", str(path), "--backend", "cpu", "--output-dir", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    printed = capsys.readouterr()
    assert "nothing to train: the checkpoint is at step 2" in printed.out, printed
    assert json.loads((out / "summary.json").read_text())["steps"] == [2, 2]
    assert main(args + ["--resume", "--max-steps", "1"]) == 2
    assert "max_steps: expected >= the resumed checkpoint's step 2, got 1" in capsys.readouterr().err


def test_indexer_warmup_trains_every_indexer_including_the_mtp_layers(small_raw, tmp_path):
    """The MTP layer runs its own indexer in the sparse stage, so the warm-up must train it as well."""
    small_raw["stages"] = [dict(kind="dense", steps=1),
                           dict(kind="indexer_warmup", steps=1, indexer_lr=5e-3, indexer_final_lr=2e-4)]
    small_raw["checkpoint"] = {"every_steps": 1, "keep_last": 10}
    run = tmp_path / "run"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run)))
    before, after = _model_at(run, 1), _model_at(run, 2)
    indexer = {k for k in before if ".indexer." in k}
    mtp_layer = small_raw["model"]["num_hidden_layers"]
    assert any(k.startswith(f"model.layers.{mtp_layer}.self_attn.indexer.") for k in indexer)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == indexer, sorted(changed ^ indexer)


def test_indexer_warmup_step_runs_no_lm_head(small_raw, tmp_path):
    """The warm-up's loss is the indexer KL alone: its steps skip the lm_head (main and MTP depths); the other
    stages' steps run it once per depth plus once for the main logits."""
    trainer = PretrainTrainer(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(tmp_path / "run")))
    calls = []
    trainer.model.lm_head.register_forward_hook(lambda *args: calls.append(1))
    heads = 1 + small_raw["loss"]["mtp_depths"]
    for step, stage in enumerate(["dense"] * 2 + ["indexer_warmup"] * 2 + ["sparse"] * 2):
        calls.clear()
        record = trainer.train_step(step)
        assert record["stage"] == stage and len(calls) == (0 if stage == "indexer_warmup" else heads), record


@pytest.mark.parametrize("installed", [True, False])
def test_cli_says_which_metrics_outputs_a_missing_package_skipped(small_raw, tmp_path, capsys, monkeypatch, installed):
    """The plot and TensorBoard need the [metrics] extra: without it the run still trains and says what it left out."""
    import sys

    import yaml

    pytest.importorskip("matplotlib")
    pytest.importorskip("torch.utils.tensorboard")
    if not installed:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    small_raw["logging"].update(tensorboard=True, plot=True)
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small_raw))
    out = tmp_path / "cli"
    assert main(["pretrain", "--config", str(path), "--backend", "cpu", "--output-dir", str(out),
                 "--max-steps", "6"]) == 0
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "loss.png").is_file() == installed and (out / "tensorboard").is_dir() == installed
    if installed:
        assert summary["metrics_skipped"] == [] and "glm5-core[metrics]" not in err
    else:
        assert summary["metrics_skipped"] == ["tensorboard (not installed)", "loss.png (matplotlib not installed)"]
        assert "skipped tensorboard (not installed), loss.png (matplotlib not installed)" in err
        assert "pip install 'glm5-core[metrics]'" in err


def test_resume_takes_the_configs_optimizer_settings_and_says_which_changed(small_raw, tmp_path, capsys):
    """Loading the optimizer's state also loads the hyper-parameters saved with it; the config must win, as it
    does for the learning rate, instead of a changed weight_decay or momentum being silently ignored."""
    run = tmp_path / "run"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run), max_steps=2))
    capsys.readouterr()
    small_raw["optimizer"] = {"weight_decay": 0.25, "muon": {"momentum": 0.9}}
    resumed = PretrainTrainer(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(tmp_path / "again"),
                                                          resume=str(run)))
    groups = {g["name"]: g for g in resumed.optimizer.param_groups}
    assert groups["muon"]["weight_decay"] == 0.25 and groups["muon"]["momentum"] == 0.9
    assert groups["adamw_main"]["weight_decay"] == 0.25 and groups["adamw_main_no_decay"]["weight_decay"] == 0.0
    err = capsys.readouterr().err
    assert "resume: the config's optimizer settings replace the checkpoint's" in err
    assert "muon.weight_decay: 0.1 -> 0.25" in err and "muon.momentum: 0.95 -> 0.9" in err
    assert ".lr:" not in err  # the schedule sets lr every step
    unchanged = PretrainTrainer(parse_config({**small_raw, "optimizer": {}}), RunOptions(
        backend="cpu", output_dir=str(tmp_path / "same"), resume=str(run)))
    assert unchanged.optimizer.param_groups[0]["weight_decay"] == 0.1
    assert "replace" not in capsys.readouterr().err  # nothing differed, nothing said
