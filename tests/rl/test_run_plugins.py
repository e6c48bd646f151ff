"""A whole sync run with a reward plug-in, dynamic sampling and held-out evaluation: the capped rounds fill
the batch, every issued trajectory is accounted for once, and the evaluations land in the metrics."""
from glm5_core.rl.driver import RLRun
from tests.rl.test_run_fault_tolerance import check_exactly_once, tiny_config


def test_sync_run_with_a_reward_plugin_dynamic_sampling_and_held_out_eval(tmp_path):
    # every trajectory samples one token, so the length reward is 2.0 for all: every group has equal rewards
    cfg = tiny_config(tmp_path, mode="sync", max_steps=2,
                      env={"name": "arithmetic", "max_operand": 3, "max_new_tokens": 1, "held_out": 0.25},
                      rollout={"num_engines": 1, "max_batch": 8, "max_len": 64, "group_size": 2},
                      reward={"path": "tests.rl.plugin_fixtures:length_reward", "scale": 2.0},
                      dynamic_sampling={"enabled": True, "max_rounds": 2},
                      eval={"every": 1, "samples_per_problem": 2, "pass_k": [1, 2]})
    run = RLRun(cfg, log=lambda m: None)
    summary = run.run()
    assert summary["steps"] == 2
    # per step: round 1 holds back 2 groups, round 2 two more; the 2 oldest fill the batch, 2 are dropped
    assert summary["dynamic_filled_groups"] == 4 and summary["dynamic_dropped_groups"] == 4
    assert summary["dynamic_dropped_by_reward"] == {"2": 4}
    assert summary["issued_trajectories"] == 16 and summary["trained_trajectories"] == 8
    check_exactly_once(run)
    assert [e["step"] for e in summary["eval_history"]] == [0, 1, 2, 2]  # start, every step, end
    assert all(e["eval_problems"] == 4 and {"eval_greedy", "eval_pass@1", "eval_pass@2"} <= set(e)
               for e in summary["eval_history"])
    logged = [r for r in run.metrics.rows if "eval_greedy" in r]
    assert [r["step"] for r in logged] == [0, 1, 2, 2]
    assert summary["eval_reward_start"] == summary["eval_start"]["eval_reward"]


def test_glm5_rl_stops_in_one_line_when_the_reward_server_fails(tmp_path, capsys):
    """reward.on_failure: fail ends the run: one line on stderr naming the server, exit 1, no traceback."""
    import yaml

    from glm5_core.cli import main

    cfg = {"seed": 0, "mode": "sync", "output_dir": str(tmp_path / "run"), "max_minutes": 5, "max_steps": 2,
           "env": {"name": "arithmetic", "max_operand": 3, "max_new_tokens": 1},
           "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
           "rollout": {"num_engines": 1, "max_batch": 4, "max_len": 64, "group_size": 2},
           "train": {"batch_size": 4}, "eval": {"samples_per_problem": 1},
           "reward": {"url": "http://127.0.0.1:9/score", "retries": 0, "timeout_s": 5}}
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["rl", "--config", str(tmp_path / "rl.yaml"), "--backend", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glm5 rl: error: reward server http://127.0.0.1:9/score failed"), err
    assert "reward.on_failure: fail" in err[0]
