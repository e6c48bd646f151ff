"""``glm5 serve`` as a separate process: glm5 rl rolls out on it through ``--engine-url`` and the arithmetic
reward rises, along the very curve of spawned engines at equal seeds (sync mode); and distributed weight sync
between two CPU processes (gloo) leaves the engine's weights bitwise equal to the trainer's."""
import json
import multiprocessing
import os
import select
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from glm5_core.cli import main
from glm5_core.rl.serving.client import EngineClient
from tests.rl.engine_process import serve_engine

DIGITS = "012"  # max_operand 1: every answer is one of these bytes


def digit_policy(path):
    """A random tiny policy whose last layer answers "a+b=" with a uniform choice among DIGITS: RL has a signal
    from the first step (reward ~1/3), without a pretraining run in the test."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM, save_pretrained

    torch.manual_seed(0)
    model = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, max_position_embeddings=64)).eval()
    captured = []
    model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(args[0][:, -1]))
    prompts = torch.tensor([list(f"{a}+{b}=".encode()) for a in range(2) for b in range(2)])  # [4, 4]
    with torch.no_grad():
        model(prompts, attention="sparse")
        u = captured[0].mean(0)  # [D] the shared direction of the last hidden states
        model.lm_head.weight.zero_()
        for d in DIGITS:
            model.lm_head.weight[ord(d)] = 8.0 * u / u.dot(u)  # logit ~8 for each digit, 0 elsewhere
    save_pretrained(model, path)
    return path


def start_serve(checkpoint, *extra):
    proc = subprocess.Popen([sys.executable, "-m", "glm5_core.cli", "serve", "--checkpoint", str(checkpoint),
                             "--port", "0", "--backend", "cpu", *extra], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    ready, _, _ = select.select([proc.stdout], [], [], 180)
    line = proc.stdout.readline() if ready else ""
    if "serving" not in line:
        proc.kill()
        raise AssertionError(f"glm5 serve did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


def test_glm5_rl_async_on_glm5_serve_trains_and_pushes_every_version(tmp_path, capsys):
    """Async mode through ``--engine-url`` with a bearer token: 30 steps train, every version reaches the server
    (its weight_version is the trainer's last), nothing fails. That the reward rises is checked where it is
    deterministic, in sync mode against spawned engines (below): on this 4-problem task an async run's end
    evaluation fell below its start in about 1 run of 4 (one update can move the policy off the digit answers,
    after which groups of equal reward carry no signal), so it is no check of the serving path."""
    checkpoint = digit_policy(tmp_path / "policy")
    proc, url = start_serve(checkpoint, "--api-key", "k", "--max-batch", "16", "--max-len", "32")
    try:
        cfg = {
            "seed": 0, "mode": "async", "output_dir": str(tmp_path / "run"), "max_minutes": 8, "max_steps": 30,
            # held_out 0: the eval set is the 4 training problems (this checks that RL through glm5 serve learns)
            "env": {"name": "arithmetic", "max_operand": 1, "template": "{a}+{b}=", "max_new_tokens": 1,
                    "held_out": 0},
            "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
            "rollout": {"max_batch": 16, "max_len": 32, "group_size": 4, "max_inflight_groups": 4,
                        "max_buffered": 16, "episode_threads": 16},
            "train": {"batch_size": 16, "max_staleness": 2, "optim": {"lr": 1e-3, "micro_batch_size": 16}},
            "eval": {"every": 0, "samples_per_problem": 32},
        }
        (tmp_path / "rl.yaml").write_text(yaml.safe_dump(cfg))
        rc = main(["rl", "--config", str(tmp_path / "rl.yaml"), "--checkpoint", str(checkpoint),
                   "--engine-url", url, "--api-key", "k", "--backend", "cpu"])
        assert rc == 0
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["steps"] == 30 and summary["producer_errors"] == []
        assert summary["trained_trajectories"] == 30 * 16 and summary["eval_reward_end"] is not None
        assert EngineClient(url, api_key="k").info()["weight_version"] == "30"
        before, after = load_file(str(checkpoint / "model-00001-of-00001.safetensors")), \
            load_file(str(tmp_path / "run" / "weights" / "v000030.safetensors"))
        assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])  # the steps moved the policy
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def sync_run_config(output_dir, steps):
    """A sync-mode run with one episode thread: requests reach the one engine one at a time, in the same order,
    so its sampler draws the same numbers for the same rows whichever process hosts it."""
    return {
        "seed": 0, "mode": "sync", "output_dir": str(output_dir), "max_minutes": 8, "max_steps": steps,
        "env": {"name": "arithmetic", "max_operand": 1, "template": "{a}+{b}=", "max_new_tokens": 1},
        "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
        "rollout": {"max_batch": 16, "max_len": 32, "group_size": 4, "episode_threads": 1},
        "train": {"batch_size": 16, "optim": {"lr": 1e-3, "micro_batch_size": 16}},
        "eval": {"every": 0, "samples_per_problem": 16},
    }


def run_rl(tmp_path, name, checkpoint, steps, *flags):
    """``glm5 rl`` in sync mode; (batch reward per step, eval rewards, the final weights)."""
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(sync_run_config(tmp_path / name, steps)))
    rc = main(["rl", "--config", str(tmp_path / f"{name}.yaml"), "--checkpoint", str(checkpoint),
               "--backend", "cpu", *flags])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(tmp_path / name / "weights" / f"v{steps:06d}.safetensors"))
    return [r["reward"] for r in rows if "reward" in r], [r["eval_reward"] for r in rows if "eval_reward" in r], \
        weights


def test_routing_and_index_replay_through_glm5_serve(tmp_path, capsys):
    """glm5 serve started with SGLang's --enable-return-routed-experts / --enable-return-indexer-topk sends the
    traces in SGLang's wire form; glm5 rl --engine-url with both replays on trains every sample with its traces."""
    checkpoint = digit_policy(tmp_path / "policy")
    proc, url = start_serve(checkpoint, "--max-batch", "16", "--max-len", "32", "--enable-return-routed-experts",
                            "--enable-return-indexer-topk")
    try:
        (tmp_path / "rl.yaml").write_text(yaml.safe_dump(sync_run_config(tmp_path / "run", 2)))
        rc = main(["rl", "--config", str(tmp_path / "rl.yaml"), "--checkpoint", str(checkpoint), "--engine-url", url,
                   "--backend", "cpu", "--set", "train.routing_replay=true", "--set", "train.index_replay=true"])
        assert rc == 0, capsys.readouterr().err
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "routing_replay_untraced_samples" in r]
        assert len(steps) == 2
        assert all(r["routing_replay_untraced_samples"] == 0 and r["index_replay_untraced_samples"] == 0
                   for r in steps)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_glm5_serve_follows_the_reward_curve_of_spawned_engines(tmp_path, capsys):
    """Equal seeds, sync mode: glm5 rl on ``glm5 serve`` (another process, reached by URL, weights synced as an
    HF directory) and on a spawned engine (glm5-named safetensors) sample the same tokens, so every step's batch
    reward, both evaluations and the final weights are bitwise equal; the evaluation reward rises."""
    checkpoint = digit_policy(tmp_path / "policy")
    steps = 20
    spawned = run_rl(tmp_path, "spawned", checkpoint, steps)
    proc, url = start_serve(checkpoint, "--max-batch", "16", "--max-len", "32")
    try:
        served = run_rl(tmp_path, "served", checkpoint, steps, "--engine-url", url,
                        "--set", "rollout.sampling_seeds=true")  # seeds as the spawned engine gets them
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    capsys.readouterr()
    (rewards, evals, weights), (served_rewards, served_evals, served_weights) = spawned, served
    assert len(rewards) == steps and served_rewards == rewards
    assert len(evals) == 2 and served_evals == evals
    assert evals[1] > evals[0], evals
    assert set(served_weights) == set(weights)
    assert all(torch.equal(served_weights[k], weights[k]) for k in weights)


class OneReplica:
    def __init__(self, client):
        self.client, self.failed = client, []

    def healthy_clients(self):
        return {"engine0": self.client}

    def mark_failed(self, name):
        self.failed.append(name)


def test_distributed_sync_between_two_processes_is_bitwise(tmp_path, monkeypatch):
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.fleet.weight_sync import DistributedWeightSync, buckets

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    # the spawned child unpickles serve_engine from tests.rl.engine_process, and spawn gives it this process's
    # sys.path: put the repository (the folder holding tests/) on it
    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = ctx.Process(target=serve_engine, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(180), "engine process did not start"
        client = EngineClient(parent.recv())
        torch.manual_seed(2)
        trainer = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8))
        state = trainer.state_dict()
        assert len(list(buckets(state, 1 << 18))) > 1  # several buckets: each a call and a broadcast
        replicas = OneReplica(client)
        sync = DistributedWeightSync(replicas, bucket_bytes=1 << 18, timeout_s=120)
        sync.push(trainer, 5)
        sync.shutdown()
        assert replicas.failed == [] and sync.failed_pushes == 0, sync.last_error
        assert client._call("GET", "/get_weight_version") == {"weight_version": "5"}
        parent.send(str(tmp_path / "engine.safetensors"))
        assert parent.poll(60) and parent.recv() == "saved"
        engine = load_file(str(tmp_path / "engine.safetensors"))
        assert set(engine) == set(state)
        assert all(torch.equal(engine[k], state[k]) for k in state), "engine weights differ from the trainer's"
        parent.send("stop")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_glm5_serve_refuses_bad_flags_with_one_line(tmp_path, capsys):
    assert main(["serve", "--checkpoint", str(tmp_path), "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--port" in err[0]
    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]
    assert "--checkpoint" in err[0] and "--host" not in err[0], err  # it once blamed --host/--port


def test_glm5_serve_points_a_run_folder_to_its_final_weights(tmp_path, capsys):
    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "final" / "config.json").write_text("{}")
    assert main(["serve", "--checkpoint", str(tmp_path / "run"), "--port", "0", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--checkpoint" in err[0] and "did you mean" in err[0], err
    assert repr(str(tmp_path / "run" / "final")) in err[0], err


def test_glm5_serve_blames_the_address_only_when_binding_fails(tmp_path, capsys):
    import socket

    checkpoint = digit_policy(tmp_path / "policy")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--checkpoint", str(checkpoint), "--port", str(port), "--backend", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host/--port: cannot bind" in err[0], err
