"""``glm5 rl`` takes the pretraining driver's parallel setting (``parallel.ep``, ``--parallel ep=N``): checked with
the config as ``glm5 pretrain`` checks it, applied to the policy by the same function (``train.fsdp.parallelize``);
on one process ``ep: 1`` trains in the expert-parallel layout, and what is not built is refused in one line."""
import math

import pytest

from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.driver import RLRun


def _config(tmp_path, **parallel):
    data = {
        "seed": 0, "mode": "sync", "output_dir": str(tmp_path / "run"), "max_minutes": 5, "max_steps": 2,
        "env": {"name": "arithmetic", "max_operand": 4, "max_new_tokens": 3},
        "model": {"preset": "tiny", "overrides": {"num_hidden_layers": 2, "indexer_types": ["full", "shared"],
                                                  "index_topk": 8}},
        "rollout": {"num_engines": 1, "max_batch": 4, "max_len": 64, "group_size": 2},
        "train": {"batch_size": 4, "optim": {"lr": 1e-4}},
        "eval": {"every": 0, "samples_per_problem": 1},
        "parallel": parallel,
    }
    return config_from_dict(data)


def test_ep1_on_one_process_trains_in_the_expert_parallel_layout(tmp_path):
    """parallel.ep 1 (strategy fsdp2): every MoE layer is switched to the expert-parallel layout (all experts
    here, the batch-invariant kernel) and a 2-step sync run finishes with finite losses."""
    rows = []
    run = RLRun(_config(tmp_path, ep=1, strategy="fsdp2"), log=lambda m: None,
                hooks=[lambda step, r: rows.append(r.metrics.rows[-1])])
    assert run.parallel is not None and run.trainer.parallel is run.parallel
    assert all(layer.expert_parallel for layer in run.model.moe_layers())
    summary = run.run()
    assert summary["steps"] == 2
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), rows


def test_without_the_setting_the_policy_is_unchanged(tmp_path):
    cfg = _config(tmp_path)
    assert cfg.parallel.ep is None
    from glm5_core.rl.policy import parallelize_policy

    class Model:  # never touched: nothing to apply
        pass

    assert parallelize_policy(cfg, Model()) is None


def test_what_is_not_built_is_refused_in_one_line(tmp_path, monkeypatch):
    """ep 2 on one process: the world size (as glm5 pretrain says it); under torchrun: what the driver lacks."""
    with pytest.raises(ValueError, match=r"parallel\.ep: expected a divisor of the world size 1, got 2"):
        RLRun(_config(tmp_path, ep=2, strategy="fsdp2"), log=lambda m: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"parallel: glm5 rl runs in one process \(WORLD_SIZE 2\): its driver"):
        RLRun(_config(tmp_path, ep=2, strategy="fsdp2"), log=lambda m: None)


def test_cli_takes_parallel_and_refuses_a_bad_ep_in_one_line(tmp_path, capsys):
    """--parallel ep=1 sets parallel.ep and parallel.strategy (as pretrain's flag); ep=3 with 8 experts and a
    malformed flag: one error line, exit 2."""
    from glm5_core.cli import main

    cfg = tmp_path / "rl.yaml"
    cfg.write_text("max_steps: 2\noutput_dir: " + str(tmp_path / "out") + "\n")
    assert main(["rl", "--config", str(cfg), "--parallel", "ep=1", "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "parallel:\n  strategy: fsdp2\n  ep: 1\n" in out, out
    for flag, expected in (("ep=3", "parallel.ep: expected a divisor of model.n_routed_experts (8), got 3"),
                           ("ep=x", "argument --parallel: expected one of ddp, fsdp2 or ep=N")):
        try:
            code = main(["rl", "--config", str(cfg), "--parallel", flag, "--check-config"])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, err
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
