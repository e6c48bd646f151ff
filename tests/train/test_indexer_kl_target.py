"""``loss.indexer_kl_target``: the sparse stage's KL trains on the configured target ("selected", the default:
each head's softmax over the selected keys; "causal": over every causal key), and the top-k recall (the dense
target's mass on the selected keys) is measured only on the ``recall_every_steps`` steps."""
import json
from pathlib import Path

import pytest

from glm5_core.ops import dsa
from glm5_core.train import ConfigError, RunOptions, parse_config, pretrain
from glm5_core.train.trainer import PretrainTrainer


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _run(small_raw, tmp_path, monkeypatch, target):
    """Run the 6-step config (sparse steps 5 and 6, recall on even steps) recording, per step, the normaliser of
    every target the model asks for."""
    if target is not None:
        small_raw["loss"]["indexer_kl_target"] = target
    small_raw["logging"]["recall_every_steps"] = 2  # 0-based steps 4 (measure) and 5 (not) are the sparse ones
    per_step, op, train_step = [], dsa.selected_attention_target, PretrainTrainer.train_step

    def recording(*args, normaliser="selected", **kwargs):
        per_step[-1].append(normaliser)
        return op(*args, normaliser=normaliser, **kwargs)

    def step_marked(self, step):
        per_step.append([])
        return train_step(self, step)

    monkeypatch.setattr(dsa, "selected_attention_target", recording)
    monkeypatch.setattr(PretrainTrainer, "train_step", step_marked)
    run = tmp_path / f"run-{target}"
    pretrain(parse_config(small_raw), RunOptions(backend="cpu", output_dir=str(run)))
    return _records(run), per_step


@pytest.mark.parametrize("target", (None, "selected", "causal"))
def test_sparse_stage_trains_on_the_configured_target_and_measures_recall_on_recall_steps(small_raw, tmp_path,
                                                                                           monkeypatch, target):
    records, per_step = _run(small_raw, tmp_path, monkeypatch, target)
    assert [r["stage"] for r in records][4:] == ["sparse"] * 2
    assert per_step[:4] == [[]] * 4  # the dense and warm-up stages use the dense target
    configured = target or "selected"
    layers = len(per_step[5])  # the indexer layers (the MTP layer's included): one target each
    assert layers >= 2 and set(per_step[5]) == {configured}  # step 6: no recall
    if configured == "selected":  # step 5 measures the recall: the dense target too
        assert sorted(per_step[4]) == sorted(["selected"] * layers + ["causal"] * layers)
    else:  # the dense target is the KL's: no second pass
        assert per_step[4] == ["causal"] * layers
    assert 0 < records[4]["topk_recall"] <= 1 and "topk_recall" not in records[5]
    assert all(r["indexer_kl"] > 0 for r in records[4:])


def test_the_sparse_loss_differs_by_target_only_in_its_kl(small_raw, tmp_path, monkeypatch):
    """Up to the first sparse step the runs are the same; that step's LM loss and recall too (the forward is), its
    KL (and so its loss) is the configured target's. The KL is weighted up so that the targets' KL difference shows
    in the float32 loss (at weight 1 it can be below the loss's rounding: 2.79e-5 vs 2.79e-5 on a loss of 6.97)."""
    small_raw["loss"]["indexer_kl_weight"] = 1000.0
    selected, _ = _run(small_raw, tmp_path, monkeypatch, "selected")
    causal, _ = _run(small_raw, tmp_path, monkeypatch, "causal")
    strip = ("tokens_per_s",)
    same = [{k: v for k, v in r.items() if k not in strip} for r in selected[:4]]
    assert same == [{k: v for k, v in r.items() if k not in strip} for r in causal[:4]]
    first_s, first_c = selected[4], causal[4]
    assert first_s["lm_loss"] == first_c["lm_loss"] and first_s["topk_recall"] == first_c["topk_recall"]
    assert first_s["indexer_kl"] != first_c["indexer_kl"] and first_s["loss"] != first_c["loss"]


@pytest.mark.parametrize("value", ("dense", "Selected", 1, None))
def test_a_bad_target_is_a_one_line_error_naming_the_key(small_raw, value):
    small_raw["loss"]["indexer_kl_target"] = value
    with pytest.raises(ConfigError, match=r"loss\.indexer_kl_target: expected one of 'selected', 'causal'") as err:
        parse_config(small_raw)
    assert "\n" not in str(err.value)


def test_the_default_target_is_selected(small_raw):
    assert parse_config(small_raw).loss.indexer_kl_target == "selected"
    small_raw["loss"]["indexer_kl_target"] = "causal"
    assert parse_config(small_raw).loss.indexer_kl_target == "causal"
