"""RL configs: every bad value is one line naming its full key, found when the config is read (issue 19, item 9),
not inside an engine worker, an idle run or a silently skipped evaluation."""
import dataclasses

import pytest

from glm5_core.cli import main
from glm5_core.config_schema import ConfigError
from glm5_core.rl.config import RLConfig
from glm5_core.rl.config_loader import check_config, config_from_dict, load_config, size_problems


@pytest.fixture(autouse=True)
def sixteen_gib_machine(monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))


def _problem(data) -> str:
    with pytest.raises(ValueError) as info:  # a ConfigError
        config_from_dict(data)
    problems = getattr(info.value, "problems", [str(info.value)])
    assert len(problems) == 1 and "\n" not in str(info.value), problems
    return problems[0]


@pytest.mark.parametrize("path", ["configs/rl_tiny.yaml", "configs/rl_smoke.yaml", "configs/rl_multiturn.yaml",
                                  "configs/rl_heldout.yaml", "configs/rl_heldout_digits.yaml"])
def test_the_shipped_configs_parse(path):
    cfg = load_config(path)
    assert cfg.model == {"preset": "tiny", "overrides": {}} and cfg.rollout.max_len <= 512


def test_the_held_out_digits_config_holds_out_only_new_combinations_of_what_training_teaches():
    from glm5_core.rl.rollout.envs.registry import build_env

    env = build_env(load_config("configs/rl_heldout_digits.yaml").env, seed=0)
    train, held = env.train_problems(), env.eval_problems()
    assert (len(train), len(held)) == (100, 25) and not set(train) & set(held)
    units_sums = {(a % 10, b) for a, b in train}
    tens = {a // 10 for a, _ in train}
    assert all((a % 10, b) in units_sums and a // 10 in tens for a, b in held)
    assert all(a % 10 + b <= 9 for a, b in train + held)  # no carry


@pytest.mark.parametrize("data, expected", [
    ({"max_minutes": "2"}, "max_minutes: expected a finite number in (0, inf), got '2'"),
    ({"seed": "abc"}, "seed: expected an integer in [0, 9007199254740992], got 'abc'"),
    ({"seed": 2 ** 64}, "seed: expected an integer in [0, 9007199254740992], got 18446744073709551616"),
    ({"rollout": {"episode_threads": 0}}, "rollout.episode_threads: expected an integer in [1, 4096], got 0"),
    ({"torch_threads": "many"}, "torch_threads: expected an integer in [1, 4096], got 'many'"),
    ({"rollout": {"max_buffered": 0}}, "rollout.max_buffered: expected an integer in [1, inf), got 0"),
    ({"eval": {"samples_per_problem": 0}}, "eval.samples_per_problem: expected an integer in [1, inf), got 0"),
    ({"rollout": {"max_len": 10 ** 9}}, "rollout.max_len: expected <= the model's max_position_embeddings=512, "
                                        "got 1000000000"),
    ({"rollout": {"max_len": "1e9"}}, "rollout.max_len: expected an integer in [2, inf), got '1e9'"),
    ({"rollout": {"max_batch": 10 ** 8}}, "rollout.max_batch: the run needs at least "),
    ({"rollout": {"num_engines": 10 ** 6}}, "rollout.num_engines: the run needs at least "),
    ({"rollout": {"num_engines": 2 ** 40}},
     "rollout.num_engines: expected an integer in [1, 1048576], got 1099511627776"),
    ({"model": {"overrides": {"hidden_size": 2 ** 24}}}, "model.overrides.hidden_size: the run needs at least "),
    ({"model": {"overrides": {"hiden_size": 64}}},
     "model.overrides.hiden_size: unknown key; did you mean 'hidden_size'?"),
    ({"model": {"overides": {}}}, "model.overides: unknown key; did you mean 'overrides'?"),
    ({"model": {"overrides": {"index_topk": 1024}}}, "model.overrides.index_topk: expected <= max_position_embeddings"),
    ({"rollout": {"max_bach": 8}}, "rollout.max_bach: unknown key; did you mean 'max_batch'?"),
    ({"mode": "asinc"}, "mode: expected one of 'sync', 'async', got 'asinc'; did you mean 'async'?"),
    ({"rollout": {"max_buffered": 8}}, "rollout.max_buffered: expected >= train.batch_size=64"),
    ({"train": {"optim": {"distill_coef": 0.5}}},
     "train.optim.distill_coef: expected 0 without train.teacher_checkpoint"),
    ({"train": {"optim": {"betas": [0.9, 1.0]}}}, "train.optim.betas: expected two values in [0, 1), got [0.9, 1.0]"),
    ({"train": {"optim": {"lr": 0}}}, "train.optim.lr: expected a number in (0, inf), got 0.0"),
    ({"train": {"teacher_checkpoint": "/dev/zero"}}, "train.teacher_checkpoint: expected a folder, got '/dev/zero'"),
    ({"env": {"name": "arithmetic", "max_operand": "four"}}, "env.max_operand: expected an integer, got 'four'"),
    ({"env": {"name": "arithmetic", "max_operand": 10 ** 7}}, "env.max_operand: expected an int in [0, 1e6]"),
    ({"env": {"name": "arithmetic", "max_operant": 4}}, "env.max_operant: unknown key; did you mean 'max_operand'?"),
    ({"env": {"name": "calculator", "pareto_alpha": "x"}}, "env.pareto_alpha: expected a finite number, got 'x'"),
    ({"env": {"name": "calculator", "byte_offset": -1}}, "env.byte_offset: expected an int >= 0, got -1"),
    ({"env": {"name": "chess"}}, "env.name: expected one of 'arithmetic', 'calculator', 'openai_agent', got 'chess'"),
])
def test_each_bad_value_is_one_line_naming_its_key(data, expected):
    problem = _problem(data)
    assert problem.startswith(expected), problem


def test_invalid_yaml_is_one_line_with_the_line_number(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text("seed: 0\nrollout: {max_batch: 8\ntrain: {}\n")
    with pytest.raises(ValueError) as info:
        load_config(str(path))
    assert str(info.value).startswith(f"{path}: line 3, column 6: not valid YAML"), str(info.value)


def test_an_empty_file_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(str(path)) == RLConfig()


def test_an_output_dir_under_a_file_is_refused(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("")
    assert _problem({"output_dir": str(blocker / "rl")}).startswith("output_dir: expected a folder that exists")


def test_a_checkpoint_architecture_is_sized_too(tmp_path):
    from glm5_core.model import GLM5Config

    cfg = config_from_dict({"model": {"preset": "mine"}, "rollout": {"max_len": 1024}})  # architecture: --checkpoint
    assert cfg.model_config() is None
    big = GLM5Config.tiny(max_position_embeddings=4096, n_routed_experts=16384)
    assert size_problems(cfg, dataclasses.replace(big, max_position_embeddings=512))[0].startswith(
        "rollout.max_len: expected <= the model's max_position_embeddings=512, got 1024")
    assert size_problems(cfg, big)[0].startswith("rollout.max_len: the run needs at least ")
    assert size_problems(cfg, GLM5Config.tiny(max_position_embeddings=4096)) == []


def test_validate_checks_an_instance_built_in_code():
    cfg = RLConfig()
    cfg.rollout.max_buffered = 0
    with pytest.raises(ValueError, match=r"rollout.max_buffered: expected an integer in \[1, inf\), got 0"):
        cfg.validate()


def test_the_checks_that_need_a_component_come_with_the_schema_problems():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"rollout": {"max_batch": 0}, "train": {"loss": "nope", "advantage": 3}})
    assert info.value.problems == [
        "rollout.max_batch: expected an integer in [1, inf), got 0", "train.advantage: expected a string, got 3",
        "train.loss: expected one of 'double_sided_is' or an import path 'pkg.module:name', got 'nope'"]


def test_check_config_adds_the_component_checks_to_validate():
    cfg = RLConfig()
    cfg.train.advantage = "nope"
    assert cfg.validate() is cfg  # rl/config checks what it can alone
    with pytest.raises(ConfigError, match=r"^config: train.advantage: expected one of 'group_normalized'"):
        check_config(cfg)
    assert check_config(RLConfig()).train.advantage == "group_normalized"


def test_values_are_converted_once_as_declared():
    cfg = config_from_dict({"rollout": {"top_p": 1, "temperature": "7e-1"}, "train": {"optim": {"betas": [0.8, 0.9]}},
                            "model": {"overrides": {"rope_theta": "1e4"}}})
    assert cfg.rollout.top_p == 1.0 and cfg.rollout.temperature == 0.7 and cfg.train.optim.betas == (0.8, 0.9)
    assert cfg.model_config().rope_theta == 1e4


def test_the_cli_takes_set_and_refuses_in_one_line(tmp_path, capsys):
    assert main(["rl", "--config", "configs/rl_tiny.yaml", "--check-config", "--set", "rollout.max_batch=32",
                 "--set", "env.max_operand=3", "--output-dir", str(tmp_path / "rl")]) == 0
    out = capsys.readouterr().out
    assert "max_batch: 32" in out and "max_operand: 3" in out and f"output_dir: {tmp_path / 'rl'}" in out
    for override, expected in [("rollout.max_len=1000000000", "rollout.max_len: expected <= the model's"),
                               ("rollout.max_bufferd=3",
                                "rollout.max_bufferd: unknown key; did you mean 'max_buffered'"),
                               ("torch_threads=many", "torch_threads: expected an integer in [1, 4096], got 'many'")]:
        assert main(["rl", "--config", "configs/rl_tiny.yaml", "--check-config", "--set", override]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err and "Traceback" not in err, err
        assert err.startswith("glm5 rl: error: --set (over configs/rl_tiny.yaml): "), err  # not the file's fault


def test_the_cli_sizes_the_checkpoint_it_will_load(tmp_path, capsys):
    from glm5_core.model import GLM5Config, GLM5ForCausalLM, save_pretrained

    save_pretrained(GLM5ForCausalLM(GLM5Config.tiny(max_position_embeddings=64, index_topk=8)), tmp_path / "ckpt")
    assert main(["rl", "--config", "configs/rl_tiny.yaml", "--check-config", "--checkpoint", str(tmp_path / "ckpt"),
                 "--set", "rollout.max_len=65"]) == 2
    assert "rollout.max_len: expected <= the model's max_position_embeddings=64, got 65" in capsys.readouterr().err
