"""``rollout.tokenizer``: glm5 rl's environments render prompts through a tokenizer directory's chat template and
decode completions with it (trained by glm5_core/rl/rollout/chat_tokenizer_builder.py), the trained token ids are
those the engine sampled, and a directory that is missing, has no chat template or more tokens than the policy's
vocab_size is refused with one line."""
import json
import re

import yaml

from glm5_core.cli import main
from glm5_core.rl.algorithm.trainer import PolicyTrainer
from glm5_core.rl.fleet.replicas import ReplicaSet
from glm5_core.rl.rollout.chat_tokenizer_builder import build_tokenizer_dir
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer


def rl_config(tmp_path, tokenizer, vocab_size=None, **env):
    overrides = {"index_topk": 8, **({"vocab_size": vocab_size} if vocab_size else {})}
    return {
        "seed": 0, "mode": "sync", "output_dir": str(tmp_path / "run"), "max_minutes": 5, "max_steps": 3,
        "env": {"name": "arithmetic", "max_operand": 9, "max_new_tokens": 3, **env},
        "model": {"preset": "tiny", "overrides": overrides},
        "rollout": {"max_batch": 8, "max_len": 32, "group_size": 4, "episode_threads": 4, "tokenizer": tokenizer},
        "train": {"batch_size": 8, "optim": {"lr": 1e-3, "micro_batch_size": 8}},
        "eval": {"every": 0, "samples_per_problem": 1},
    }


def write_config(tmp_path, cfg):
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_glm5_rl_trains_on_the_token_ids_the_engine_sampled_through_the_tokenizer(tmp_path, monkeypatch, capsys):
    directory = build_tokenizer_dir(str(tmp_path / "tok"))
    tokenizer = load_chat_tokenizer(directory)
    sampled, trained = {}, []
    generate, train_step = ReplicaSet.generate, PolicyTrainer.train_step

    def recording_generate(self, trajectory_id, request):
        response = generate(self, trajectory_id, request)
        sampled.setdefault(trajectory_id, []).append((list(request["input_ids"]), list(response["output_ids"])))
        return response

    def recording_train_step(self, trajectories):
        trained.extend(trajectories)
        return train_step(self, trajectories)

    monkeypatch.setattr(ReplicaSet, "generate", recording_generate)
    monkeypatch.setattr(PolicyTrainer, "train_step", recording_train_step)
    config = write_config(tmp_path, rl_config(tmp_path, directory, vocab_size=tokenizer.min_vocab_size))
    rc = main(["rl", "--config", config, "--backend", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    last = out.strip().splitlines()[-1]  # after the [rl] progress lines, one human line, no JSON
    assert last.startswith("rl: 3 steps (sync); eval reward ") and "results in " in last and "{" not in out, out
    assert len(trained) == 3 * 8
    outputs = []
    for trajectory in trained:
        (prompt, output), = sampled[trajectory.trajectory_id]  # one turn per arithmetic episode
        sample, = trajectory.samples
        assert sample.tokens == prompt + output  # the sampled ids, as the engine returned them
        assert sample.loss_mask == [0] * len(prompt) + [1] * len(output)
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        user_turn = r"<\|im_start\|>user<\|im_sep\|>(\d\+\d=)<\|im_end\|><\|im_start\|>assistant<\|im_sep\|>"
        question = re.fullmatch(user_turn, text).group(1)
        # the chat template's user turn, in the tokenizer's ids (transformers' own rendering), not bytes
        assert prompt == tokenizer.hf.apply_chat_template([{"role": "user", "content": question}],
                                                          add_generation_prompt=True, tokenize=True, return_dict=False)
        assert prompt != ByteCodec().encode(text)
        outputs += output
    assert max(outputs) >= 256  # the engine samples over the tokenizer's vocabulary, past the byte range


def refusal(tmp_path, capsys, cfg):
    rc = main(["rl", "--config", write_config(tmp_path, cfg), "--check-config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    return err[0]


def test_a_missing_tokenizer_directory_is_refused_with_one_line(tmp_path, capsys):
    line = refusal(tmp_path, capsys, rl_config(tmp_path, str(tmp_path / "missing"), vocab_size=1024))
    assert "rollout.tokenizer" in line and "missing" in line


def test_a_tokenizer_without_chat_template_is_refused_with_one_line(tmp_path, capsys):
    directory = build_tokenizer_dir(str(tmp_path / "tok"))
    config_file = tmp_path / "tok" / "tokenizer_config.json"
    config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items()
                                       if k != "chat_template"}))
    line = refusal(tmp_path, capsys, rl_config(tmp_path, directory, vocab_size=1024))
    assert "rollout.tokenizer" in line and "chat template" in line


def test_a_tokenizer_larger_than_the_policy_vocabulary_is_refused_with_one_line(tmp_path, capsys):
    directory = build_tokenizer_dir(str(tmp_path / "tok"))
    size = load_chat_tokenizer(directory).min_vocab_size
    line = refusal(tmp_path, capsys, rl_config(tmp_path, directory, vocab_size=size - 1))
    assert "rollout.tokenizer" in line and f"{size} token ids" in line and f"vocab_size={size - 1}" in line
    assert main(["rl", "--config", write_config(tmp_path, rl_config(tmp_path, directory, vocab_size=size)),
                 "--check-config"]) == 0
    assert "tokenizer: " in capsys.readouterr().out


def test_env_byte_offset_with_a_tokenizer_is_refused_with_one_line(tmp_path, capsys):
    directory = build_tokenizer_dir(str(tmp_path / "tok"))
    line = refusal(tmp_path, capsys, rl_config(tmp_path, directory, vocab_size=1024, byte_offset=8))
    assert line.count("env.byte_offset") == 2 and "rollout.tokenizer" in line
