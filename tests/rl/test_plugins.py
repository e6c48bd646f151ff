"""Plug-ins by import path: environments, rewards, losses and advantage estimators are a built-in name or
``pkg.module:name``, checked when the config is read; an unknown name is an error naming the choices."""
import pytest

from glm5_core.config_schema import ConfigError
from glm5_core.rl.algorithm.advantages import group_centred, group_normalized, resolve_advantage
from glm5_core.rl.algorithm.loss import double_sided_is_loss, resolve_loss
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.plugins import load_object, resolve_callable
from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv
from glm5_core.rl.rollout.envs.calculator import CalculatorEnv
from glm5_core.rl.rollout.envs.registry import build_env
from tests.rl import plugin_fixtures

FIXTURES = "tests.rl.plugin_fixtures"
UNKNOWN_CHESS = "env.name: expected one of 'arithmetic', 'calculator', 'openai_agent', got 'chess'"


@pytest.fixture(autouse=True)
def enough_memory(monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))


def _problem(data):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


def test_build_env_refuses_an_unknown_name_instead_of_building_the_calculator():
    with pytest.raises(ValueError, match=UNKNOWN_CHESS):
        build_env({"name": "chess"}, seed=0)
    with pytest.raises(ValueError, match="did you mean 'arithmetic'"):
        build_env({"name": "arithmetc"}, seed=0)
    assert isinstance(build_env({"name": "calculator"}, seed=0), CalculatorEnv)
    assert isinstance(build_env({"name": "arithmetic", "max_operand": 3}, seed=0), ArithmeticEnv)


def test_an_environment_by_import_path_gets_its_keys_the_codec_and_the_run_seed():
    env = build_env({"path": f"{FIXTURES}:ConstantEnv", "a": 3, "byte_offset": 2}, seed=11)
    assert isinstance(env, plugin_fixtures.ConstantEnv)
    assert (env.a, env.b, env.seed, env.codec.offset) == (3, 1, 11, 2)
    env = build_env({"path": f"{FIXTURES}:make_constant_env", "a": 2, "b": 4}, seed=5)  # a factory function
    assert (env.a, env.b, env.seed) == (2, 4, 5)
    assert config_from_dict({"env": {"path": f"{FIXTURES}:ConstantEnv", "a": 1}}).env["a"] == 1


@pytest.mark.parametrize("env,expected", [
    ({"path": f"{FIXTURES}:ConstantEnv", "a": 1, "c": 2}, "env.c: unknown key (known: a, b, byte_offset, path)"),
    ({"path": f"{FIXTURES}:ConstantEnv", "a": "x"}, "env.a: expected an integer, got 'x'"),
    ({"path": f"{FIXTURES}:ConstantEnv", "a": -1}, "env.a: expected an int >= 0, got -1"),
    ({"path": f"{FIXTURES}:ConstantEnv"}, "env.a: required by tests.rl.plugin_fixtures:ConstantEnv, missing"),
    ({"path": f"{FIXTURES}:not_an_env"}, "env.path: expected the factory to return a glm5_core"),
    ({"path": f"{FIXTURES}:NOT_CALLABLE"}, "env.path: 'tests.rl.plugin_fixtures:NOT_CALLABLE' names a int"),
    ({"path": "tests.rl.no_such_module:Env"}, "env.path: cannot import module 'tests.rl.no_such_module'"),
    ({"path": f"{FIXTURES}:Missing"}, f"env.path: module '{FIXTURES}' has no attribute 'Missing'"),
    ({"path": "not a path"}, "env.path: expected an import path 'pkg.module:name', got 'not a path'"),
    ({"name": "arithmetic", "path": f"{FIXTURES}:ConstantEnv"}, "env: expected 'name' (a built-in) or 'path'"),
    ({"name": "chess"}, UNKNOWN_CHESS),
])
def test_each_bad_environment_is_one_line_naming_its_key(env, expected):
    problem = _problem({"env": env})
    assert problem.startswith(expected), problem


def test_load_object_and_resolve_callable():
    assert load_object("glm5_core.rl.algorithm.advantages:group_normalized", "k") is group_normalized
    assert load_object(f"{FIXTURES}:ConstantEnv.new_group", "k") is plugin_fixtures.ConstantEnv.new_group
    builtins = {"one": len}
    assert resolve_callable("one", builtins, "k") is len
    with pytest.raises(ValueError, match=r"^k: expected one of 'one' or an import path 'pkg.module:name', got 'two'"):
        resolve_callable("two", builtins, "k")
    with pytest.raises(ValueError, match="names a int, expected a callable"):
        resolve_callable(f"{FIXTURES}:NOT_CALLABLE", builtins, "k")


def test_losses_and_advantage_estimators_by_name_or_path():
    assert resolve_loss("double_sided_is") is double_sided_is_loss
    assert resolve_loss(f"{FIXTURES}:scaled_loss") is plugin_fixtures.scaled_loss
    assert resolve_advantage("group_normalized") is group_normalized
    assert resolve_advantage("group_centred") is group_centred
    assert resolve_advantage(f"{FIXTURES}:mean_zero_advantage") is plugin_fixtures.mean_zero_advantage
    cfg = config_from_dict({"train": {"loss": f"{FIXTURES}:scaled_loss", "advantage": "group_centred"}})
    assert (cfg.train.loss, cfg.train.advantage) == (f"{FIXTURES}:scaled_loss", "group_centred")


@pytest.mark.parametrize("train,expected", [
    ({"loss": "ppo"}, "train.loss: expected one of 'double_sided_is' or an import path 'pkg.module:name', got 'ppo'"),
    ({"advantage": "grpo"}, "train.advantage: expected one of 'group_normalized', 'group_centred' or an import path"),
    ({"advantage": f"{FIXTURES}:broken_advantage"}, "train.advantage: 'tests.rl.plugin_fixtures:broken_advantage' "
                                                    "failed on rewards [1.0, 0.0] of one group (TypeError"),
    ({"advantage": f"{FIXTURES}:one_advantage_for_all"},
     "train.advantage: 'tests.rl.plugin_fixtures:one_advantage_for_all' must return one finite float per trajectory"),
    ({"loss": f"{FIXTURES}:mean_zero_advantage"}, "train.loss: 'tests.rl.plugin_fixtures:mean_zero_advantage' "
                                                  "failed on a one-token batch"),
    ({"truncation": "drop"}, "train.truncation: expected one of"),
])
def test_each_bad_loss_or_advantage_is_one_line_naming_its_key(train, expected):
    problem = _problem({"train": train})
    assert problem.startswith(expected), problem


def test_group_centred_subtracts_the_group_mean_only():
    assert group_centred([1.0, 0.0, 0.0, 3.0, 3.0], ["a", "a", "a", "b", "b"]) == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0])


def test_a_trainer_steps_with_the_configured_loss_and_estimator(tiny_policy):
    """The trainer calls the plug-ins it is given, not the built-ins."""
    from glm5_core.rl.algorithm.trainer import PolicyTrainer, TrainerConfig
    from glm5_core.rl.rollout.trajectory import Sample, Trajectory

    calls = []

    def advantage(rewards, group_ids):
        calls.append("advantage")
        return group_normalized(rewards, group_ids)

    def loss(*args, **kwargs):
        calls.append("loss")
        return double_sided_is_loss(*args, **kwargs)

    def trajectory(i, reward):
        s = Sample()
        s.append([1, 2, 3], sampled=False)
        s.append([4, 5], sampled=True, logprobs=[-1.0, -1.0], versions=[0, 0])
        return Trajectory(f"t{i}", "g", [s], reward)

    trainer = PolicyTrainer(tiny_policy, TrainerConfig(), temperature=1.0, loss_fn=loss, advantage_fn=advantage)
    trainer.train_step([trajectory(0, 1.0), trajectory(1, 0.0)])
    assert calls == ["advantage", "loss"]


def test_glm5_rl_exits_2_with_one_line_for_an_unknown_environment(tmp_path, capsys):
    from glm5_core.cli import main

    config = tmp_path / "rl.yaml"
    config.write_text("env: {name: chess}\n")
    assert main(["rl", "--config", str(config), "--check-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and UNKNOWN_CHESS in err
