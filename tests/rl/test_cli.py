"""``glm5 rl``'s closing line: the run in one human line, as pretraining ends (the JSON is in summary.json)."""
from glm5_core.rl.cli import summary_line

SUMMARY = {"steps": 12, "mode": "async", "eval_reward_start": 0.25, "eval_reward_end": 0.8125,
           "trained_tokens_per_s": 1234.4, "elapsed_s": 61.7, "env_failures": 0, "rollout_failures": 2,
           "failed_pushes": 0, "agent_failures": {"timeout": 1, "crash": 2}, "producer_errors": []}


def test_the_closing_line_names_the_eval_reward_the_failures_and_the_folder():
    line = summary_line(SUMMARY, "runs/rl")
    assert line == ("rl: 12 steps (async); eval reward 0.250 (step 0) -> 0.812 (step 12); 1234 trained tokens/s; "
                    "rollout_failures 2, agent_failures 3; 62 s; results in runs/rl (summary.json)")
    quiet = summary_line({**SUMMARY, "rollout_failures": 0, "agent_failures": {}, "eval_reward_end": None}, "x")
    assert quiet == "rl: 12 steps (async); no evaluation; 1234 trained tokens/s; 62 s; results in x (summary.json)"
