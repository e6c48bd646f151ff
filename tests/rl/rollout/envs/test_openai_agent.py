"""``env: {name: openai_agent}``: glm5 rl trains an unmodified ``openai``-package agent through the OpenAI proxy.

The run-level test trains the shipped calculator agent (configs/rl_openai_agent.yaml) against spawned engines with
a small tokenizer trained here: every trained sample holds, turn after turn, the prompt ids the proxy sent and the
ids the engine sampled (with its log-probs), and the loss mask is 1 on exactly those sampled ids. The policy tests
drive the environment through the rollout runner with a scripted engine: agents that raise, hang, never call the
proxy or return no number are counted and dropped, zeroed or stop the run, as ``on_failure`` says.
"""
import json
import types

import pytest
import yaml

from glm5_core.cli import main
from glm5_core.rl.algorithm.trainer import PolicyTrainer
from glm5_core.rl.fleet.replicas import ReplicaSet
from glm5_core.rl.rollout.chat_tokenizer_builder import build_tokenizer_dir
from glm5_core.rl.rollout.envs.openai_agent import AgentError, OpenAIAgentEnv
from glm5_core.rl.rollout.runner import RolloutRunner
from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer
from tests.rl.rollout.test_proxy import CalculatorModel, Recorder

AGENT = "glm5_core.rl.rollout.envs.calculator_agent:calculator_agent"
TASKS = "glm5_core.rl.rollout.envs.calculator_agent:calculator_task"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_chat_tokenizer(tok_dir)


def assert_trained_exactly_the_engines_tokens(trajectory, turns):
    """One append-only sample: each turn's prompt extends it, the engine's sampled ids and log-probs follow, and
    the mask is 1 on exactly the sampled ids."""
    (sample,) = trajectory.samples
    expected_mask = []
    for request, response in turns:
        prompt, out = request["input_ids"], response["output_ids"]
        assert sample.tokens[:len(prompt)] == prompt
        assert sample.tokens[len(prompt):len(prompt) + len(out)] == out
        logprobs = [e[0] for e in response["meta_info"]["output_token_logprobs"]]
        assert sample.logprobs[len(prompt):len(prompt) + len(out)] == logprobs
        expected_mask += [0] * (len(prompt) - len(expected_mask)) + [1] * len(out)
    assert sample.loss_mask == expected_mask and len(sample.tokens) == len(expected_mask)


def test_glm5_rl_trains_the_calculator_agent_through_the_proxy(tmp_path, tok_dir, tok, monkeypatch, capsys):
    sampled, trained = {}, []
    generate, train_step = ReplicaSet.generate, PolicyTrainer.train_step

    def recording_generate(self, trajectory_id, request):
        response = generate(self, trajectory_id, request)
        sampled.setdefault(trajectory_id, []).append((request, response))
        return response

    def recording_train_step(self, trajectories):
        trained.extend(trajectories)
        return train_step(self, trajectories)

    monkeypatch.setattr(ReplicaSet, "generate", recording_generate)
    monkeypatch.setattr(PolicyTrainer, "train_step", recording_train_step)
    sets = [f"rollout.tokenizer={tok_dir}", f"output_dir={tmp_path / 'run'}", "max_steps=2", "env.max_tokens=6",
            f"model.overrides.vocab_size={tok.min_vocab_size}", "model.overrides.index_topk=8",
            "rollout.group_size=2", "rollout.max_batch=8", "rollout.max_len=448", "train.batch_size=4",
            "train.optim.micro_batch_size=4",  # rewards that differ within a group: the policy gets a gradient
            "reward={path: 'tests.rl.rollout.envs.agent_fixtures:token_sum_reward'}"]
    rc = main(["rl", "--config", "configs/rl_openai_agent.yaml", "--backend", "cpu",
               *[a for s in sets for a in ("--set", s)]])
    assert rc == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["agent_failures"] == {k: 0 for k in summary["agent_failures"]}
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert any(r.get("grad_norm", 0) > 0 for r in rows)  # it trained on the agent's trajectories
    assert len(trained) == 2 * 4
    for trajectory in trained:
        turns = sampled[trajectory.trajectory_id]
        assert len(turns) == trajectory.num_turns >= 2  # a calculator task has one turn per number, then the answer
        assert_trained_exactly_the_engines_tokens(trajectory, turns)
        first_prompt = tok.decode(turns[0][0]["input_ids"], skip_special_tokens=False)
        assert first_prompt.startswith("<|im_start|>system<|im_sep|>") and '"name": "calc"' in first_prompt
        for request, _ in turns:  # the run's sampling, with its per-turn seeds
            assert request["sampling_params"]["temperature"] == 1.0 and "sampling_seed" in request["sampling_params"]
        assert not trajectory.env_failed


def test_glm5_rl_stops_in_one_line_when_an_agent_fails_under_on_failure_fail(tmp_path, tok_dir, tok, capsys):
    sets = [f"rollout.tokenizer={tok_dir}", f"output_dir={tmp_path / 'run'}", "env.on_failure=fail",
            "env.agent=tests.rl.rollout.envs.agent_fixtures:raising_agent", "env.max_tokens=2",
            f"model.overrides.vocab_size={tok.min_vocab_size}", "model.overrides.index_topk=8",
            "rollout.group_size=2", "rollout.max_batch=4", "train.batch_size=2", "train.optim.micro_batch_size=2"]
    rc = main(["rl", "--config", "configs/rl_openai_agent.yaml", "--backend", "cpu",
               *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("glm5 rl: error: agent failed (exception) on trajectory 'g0-")
    assert "RuntimeError: agent bug (env.on_failure: fail)" in err[0]


# -- the per-episode failure policy, through the rollout runner -----------------------------------------------
def play(tok, agent, *, on_failure="drop", timeout_s=30.0, group_size=2, generate=None, tasks=TASKS, **runner_kw):
    env = OpenAIAgentEnv(agent=agent, tasks=tasks, on_failure=on_failure, timeout_s=timeout_s, max_tokens=64,
                         codec=tok, seed=0)
    recorder = Recorder(generate or CalculatorModel(tok))
    runner = RolloutRunner(env, recorder, group_size=group_size, temperature=1.0, top_p=1.0, max_len=1024, seed=3,
                           **runner_kw)
    try:
        return runner.run_groups(1), env, runner, recorder
    finally:
        runner.shutdown()
        env.close()


def test_the_example_agent_solves_its_task_with_a_scripted_model(tok):
    trajectories, env, runner, recorder = play(tok, AGENT)
    assert [t.reward for t in trajectories] == [1.0, 1.0]  # tool calls and results round-tripped
    for t in trajectories:
        assert_trained_exactly_the_engines_tokens(t, recorder.of(t.trajectory_id))
    assert runner.env_failures == 0 and env.failure_counts() == {k: 0 for k in env.failure_counts()}


def test_agent_requests_ask_the_engines_for_the_replay_traces_the_trainer_replays(tok):
    _, _, _, recorder = play(tok, AGENT, return_routed_experts=True)
    assert recorder.calls and all(request.get("return_routed_experts") is True and "return_indexer_topk" not in request
                                  for _, request, _ in recorder.calls)
    _, _, _, recorder = play(tok, AGENT)
    assert not any("return_routed_experts" in request for _, request, _ in recorder.calls)


@pytest.mark.parametrize("agent, kind", [("raising_agent", "exception"), ("silent_agent", "no_requests"),
                                         ("text_reward_agent", "bad_reward")])
def test_a_failing_agent_is_counted_and_its_group_dropped(tok, agent, kind):
    trajectories, env, runner, _ = play(tok, f"tests.rl.rollout.envs.agent_fixtures:{agent}")
    assert all(t.env_failed and t.reward == 0.0 for t in trajectories)
    assert env.failure_counts()[kind] == 2 and runner.env_failures == 2
    assert kind in env.last_error


def test_an_agent_past_its_timeout_is_dropped_without_waiting_for_it(tok):
    import threading

    trajectories, env, _, recorder = play(tok, "tests.rl.rollout.envs.agent_fixtures:hanging_agent", timeout_s=0.5)
    hanging = [t for t in threading.enumerate() if t.name in ("agent-g0-0", "agent-g0-1")]
    assert len(hanging) == 2 and all(t.is_alive() for t in hanging)  # the agents sleep 10 s: not waited for
    assert all(t.env_failed for t in trajectories) and env.failure_counts()["timeout"] == 2
    for thread in hanging:
        thread.join(30)
    # their late requests were refused (trajectory closed, proxy stopped), never recorded
    assert not any(t.is_alive() for t in hanging) and len(recorder.calls) == 2
    assert all(isinstance(t.error, Exception) for t in hanging)


def test_on_failure_zero_trains_what_the_agent_recorded_with_reward_zero(tok):
    scorer = {"calls": 0}

    def reward_plugin(payload):  # not asked: the failure's reward is 0
        scorer["calls"] += 1
        return 1.0

    trajectories, env, runner, recorder = play(tok, "tests.rl.rollout.envs.agent_fixtures:raising_agent",
                                               on_failure="zero", reward_fn=reward_plugin)
    assert scorer["calls"] == 0
    for t in trajectories:
        assert not t.env_failed and t.reward == 0.0
        assert_trained_exactly_the_engines_tokens(t, recorder.of(t.trajectory_id))
    assert env.failure_counts()["exception"] == 2 and runner.env_failures == 0
    silent, env, _, _ = play(tok, "tests.rl.rollout.envs.agent_fixtures:silent_agent", on_failure="zero")
    assert all(t.env_failed for t in silent)  # nothing recorded: nothing to train


def test_on_failure_fail_stops_with_the_agents_error(tok):
    with pytest.raises(AgentError, match=r"agent failed \(exception\).*RuntimeError: agent bug.*on_failure: fail"):
        play(tok, "tests.rl.rollout.envs.agent_fixtures:raising_agent", on_failure="fail")


def test_the_agent_reward_goes_to_the_reward_plugin(tok):
    from glm5_core.rl.rollout.rewards import build_reward

    env = OpenAIAgentEnv(agent="tests.rl.rollout.envs.agent_fixtures:constant_agent", tasks=TASKS, codec=tok, seed=0)
    scorer = build_reward({"path": "tests.rl.plugin_fixtures:length_reward", "scale": 2.0})
    seen = []
    runner = RolloutRunner(env, CalculatorModel(tok), group_size=1, temperature=1.0, top_p=1.0, max_len=1024,
                           reward_fn=lambda payload: seen.append(payload) or scorer(payload))
    try:
        (trajectory,) = runner.run_groups(1)
    finally:
        runner.shutdown()
        env.close()
    (payload,) = seen
    assert payload["env_reward"] == 0.5 and payload["num_turns"] == 1
    assert payload["response_ids"] == [t for t, m in zip(trajectory.samples[0].tokens,
                                                         trajectory.samples[0].loss_mask) if m]
    assert trajectory.reward == scorer(payload) != 0.5


# -- config checks: one line, exit 2 -------------------------------------------------------------------------
def refusal(tmp_path, capsys, env, tokenizer):
    cfg = yaml.safe_load(open("configs/rl_openai_agent.yaml"))
    cfg["env"] = env
    cfg["rollout"]["tokenizer"] = tokenizer
    cfg["model"]["overrides"] = {"vocab_size": 1024}
    cfg["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc = main(["rl", "--config", str(path), "--check-config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("env, expected", [
    ({"name": "openai_agent", "agent": AGENT, "tasks": TASKS, "timout_s": 3}, "env.timout_s: unknown key"),
    ({"name": "openai_agent", "agent": AGENT, "tasks": TASKS, "timeout_s": "soon"}, "env.timeout_s: expected"),
    ({"name": "openai_agent", "agent": AGENT, "tasks": TASKS, "timeout_s": 0}, "env.timeout_s: expected seconds"),
    ({"name": "openai_agent", "agent": AGENT, "tasks": TASKS, "on_failure": "retry"}, "env.on_failure: expected one"),
    ({"name": "openai_agent", "agent": AGENT, "tasks": TASKS, "max_tokens": 0}, "env.max_tokens: expected an int"),
    ({"name": "openai_agent", "agent": "no.such.module:agent", "tasks": TASKS}, "env.agent: cannot import module"),
    ({"name": "openai_agent", "agent": "glm5_core.rl.rollout.envs.calculator_agent:SYSTEM", "tasks": TASKS},
     "env.agent: "),
    ({"name": "openai_agent", "agent": AGENT}, "env.tasks: required by openai_agent, missing"),
    ({"name": "openai_agent", "agent": AGENT, "tasks": "tests.rl.rollout.envs.agent_fixtures:broken_task"},
     "env.tasks: tests.rl.rollout.envs.agent_fixtures:broken_task(rng) raised KeyError"),
])
def test_bad_openai_agent_settings_are_one_line(tmp_path, capsys, tok_dir, env, expected):
    assert expected in refusal(tmp_path, capsys, env, tok_dir)


def test_openai_agent_without_a_tokenizer_is_one_line(tmp_path, capsys):
    line = refusal(tmp_path, capsys, {"name": "openai_agent", "agent": AGENT, "tasks": TASKS}, None)
    assert "rl.yaml: rollout.tokenizer: env 'openai_agent' needs a tokenizer directory with a chat template" in line


def test_the_example_config_fits_its_agents_longest_conversation(tmp_path):
    """configs/rl_openai_agent.yaml's max_len holds the calculator agent's longest plausible conversation under the
    tokenizer ``glm5 make-tokenizer`` writes: three numbers, each turn answered with two malformed tool calls (a
    random policy's) and their error results, every assistant turn at the env's max_tokens. With max_len 512 a
    run dropped 35 of 116 episodes for 518-token prompts."""
    from glm5_core.rl.rollout.envs.calculator_agent import CALC_TOOL, SYSTEM, tool_result

    cfg = yaml.safe_load(open("configs/rl_openai_agent.yaml"))
    tok = load_chat_tokenizer(build_tokenizer_dir(str(tmp_path / "tok")))
    bad_call = types.SimpleNamespace(function=types.SimpleNamespace(name="calc", arguments="{"))
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "calc", "arguments": "{"}} for i in range(2)]
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(3):
        messages.append({"role": "user", "content": f"{'First' if i == 0 else 'Next'}: 9"})
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": tool_result(bad_call)} for c in calls]
    messages.append({"role": "user", "content": "answer:"})
    prompt = len(tok.encode_rendered(tok.render(messages, tools=[CALC_TOOL], add_generation_prompt=True)))
    sampled = 4 * (cfg["env"]["max_tokens"] + 1)  # every assistant turn at max_tokens, plus its end-of-turn token
    assert prompt + sampled <= cfg["rollout"]["max_len"], (prompt, sampled)
