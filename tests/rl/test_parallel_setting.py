"""``glm5 rl`` takes the pretraining driver's parallel setting (``parallel.ep``, ``--parallel ep=N``): checked with
the config as ``glm5 pretrain`` checks it, applied to the policy by the same function (``train.fsdp.parallelize``);
on one process ``ep: 1`` trains in the expert-parallel layout; under torchrun (2 gloo ranks) a 2-step run at
EP=2 finishes, rank 0 driving the rollouts and the other rank training its share; what is not built is refused
in one line."""
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


def test_ep2_on_one_process_is_refused_naming_the_world_size(tmp_path):
    """As glm5 pretrain says it."""
    with pytest.raises(ValueError, match=r"parallel\.ep: expected a divisor of the world size 1, got 2"):
        RLRun(_config(tmp_path, ep=2, strategy="fsdp2"), log=lambda m: None)


def _main(args):
    from glm5_core.cli import main

    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


def test_what_torchrun_runs_do_not_do_yet_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Under torchrun (WORLD_SIZE 2), before any rank joins the process group: ddp, --resume, distributed weight
    sync and external engines, one error line each naming the setting, exit 2."""
    cfg = tmp_path / "rl.yaml"
    cfg.write_text("max_steps: 2\noutput_dir: " + str(tmp_path / "out") + "\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cases = [(["--parallel", "ddp"], "parallel.strategy: glm5 rl under torchrun trains the policy with fsdp2"),
             (["--parallel", "ep=2", "--resume", str(tmp_path / "out")], "--resume: glm5 rl under torchrun writes no"),
             (["--parallel", "ep=2", "--set", "rollout.weight_sync=distributed"], "rollout.weight_sync: glm5 rl "
              "under torchrun pushes weights from its weight files"),
             (["--parallel", "ep=2", "--engine-url", "http://127.0.0.1:9"], "rollout.engine_urls: glm5 rl under "
              "torchrun spawns its engines")]
    for extra, expected in cases:
        code = _main(["rl", "--config", str(cfg), "--backend", "cpu", *extra])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error" in line]
        assert code == 2 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err, (extra, err)


def test_cli_takes_parallel_and_refuses_a_bad_ep_in_one_line(tmp_path, capsys):
    """--parallel ep=1 sets parallel.ep and parallel.strategy (as pretrain's flag); ep=3 with 8 experts and a
    malformed flag: one error line, exit 2."""
    cfg = tmp_path / "rl.yaml"
    cfg.write_text("max_steps: 2\noutput_dir: " + str(tmp_path / "out") + "\n")
    assert _main(["rl", "--config", str(cfg), "--parallel", "ep=1", "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "parallel:\n  strategy: fsdp2\n  ep: 1\n" in out, out
    for flag, expected in (("ep=3", "parallel.ep: expected a divisor of model.n_routed_experts (8), got 3"),
                           ("ep=x", "argument --parallel: expected one of ddp, fsdp2 or ep=N")):
        code = _main(["rl", "--config", str(cfg), "--parallel", flag, "--check-config"])
        err = capsys.readouterr().err
        assert code == 2, err
        errors = [line for line in err.splitlines() if "error" in line]
        assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err


@pytest.mark.slow
def test_two_ranks_under_torchrun_train_at_ep2(tmp_path):
    """``torchrun --nproc_per_node=2 -m glm5_core.cli rl --parallel ep=2``: a 2-step sync run finishes (rank 0's
    driver, one spawned engine, rank 1 training its share of each step), every loss finite, both ranks exit 0.
    Slow (~50 s here): the default run's tests/rl/algorithm/test_parallel_trainer.py covers the trainer's ranks,
    EP=2 against one process, through the same follow / release calls."""
    import json
    import subprocess

    import yaml

    from tests.train import ep_golden

    out = tmp_path / "run"
    data = dataclass_plain(_config(tmp_path))
    data.update(output_dir=str(out), torch_threads=1)
    cfg = tmp_path / "rl.yaml"
    cfg.write_text(yaml.safe_dump(data))
    cmd = ep_golden.torchrun_cmd(2) + ["-m", "glm5_core.cli", "rl", "--config", str(cfg), "--backend", "cpu",
                                       "--parallel", "ep=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ep_golden.run_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), rows
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert "no resume point written" in proc.stdout + proc.stderr
    assert list((out / "weights").glob("v*.safetensors"))  # gathered on rank 0 for the engine


def dataclass_plain(cfg):
    from glm5_core.config_schema import as_plain

    return as_plain(cfg)
