"""A partial RL run plots the steps it trained and says so: interrupted (Ctrl-C: the reward curve titled as
partial, one log line naming it), or ended by the max_minutes budget before max_steps (the summary and the
closing line say so)."""
import pytest

from glm5_core.rl.cli import summary_line
from glm5_core.rl.driver import RLRun
from tests.rl.test_run_fault_tolerance import tiny_config


def test_an_interrupted_rl_run_plots_what_it_trained_and_says_so(tmp_path):
    def interrupt_at_step_2(step, run):
        if step == 2:
            raise KeyboardInterrupt

    lines = []
    cfg = tiny_config(tmp_path, mode="sync", max_steps=4,
                      env={"name": "arithmetic", "max_operand": 3, "max_new_tokens": 1},
                      rollout={"num_engines": 1, "max_batch": 4, "max_len": 64, "group_size": 2})
    run = RLRun(cfg, hooks=[interrupt_at_step_2], log=lines.append)
    titles = []
    real = run.metrics.reward_curve

    def recording(path=None, title="reward"):
        titles.append(title)
        return real(path, title)

    run.metrics.reward_curve = recording
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert len(titles) == 1 and "partial run, interrupted at step 2 of 4" in titles[0], titles
    said = [line for line in lines if "interrupted at step 2 of 4" in line]
    assert len(said) == 1, lines
    assert ("reward_curve.png plots the steps trained" in said[0]) == (tmp_path / "reward_curve.png").is_file()


def test_the_closing_line_says_when_the_budget_ended_the_run_first():
    summary = {"steps": 3, "mode": "async", "trained_tokens_per_s": 10.0, "elapsed_s": 60.0,
               "eval_reward_start": 0.1, "eval_reward_end": 0.2, "partial": {"steps_done": 3, "max_steps": 10}}
    line = summary_line(summary, "runs/x")
    assert "partial run: the max_minutes budget ended it before max_steps 10" in line and "\n" not in line
    del summary["partial"]
    assert "partial" not in summary_line(summary, "runs/x")
