"""glm5 rl against a server that behaves as SGLang 0.5.23 and 0.5.15.post1 do (tests/rl/serving/sglang_standin.py,
its own process, none of glm5-core's serving code inside): the client reads its bodies, its request contract
holds, and RL with multi-token answers trains through several weight pushes, by disk and by the distributed
path, async and sync, with the engine's weights ending bitwise equal to the trainer's last push."""
import json
import threading
import time

import pytest
import torch
import yaml

from glm5_core.cli import main
from glm5_core.rl.serving.client import EngineClient, EngineRequestError, EngineUnavailable
from tests.rl.serving.sglang_standin import NO_SESSION, StandInProcess

KEY = "s3cret"


def random_policy(path):
    """Not the trainer's weights (seed 123): a run must push its own before rolling out."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM, save_pretrained

    torch.manual_seed(123)
    save_pretrained(GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, max_position_embeddings=64)).eval(), path,
                    transformers_form=False)
    return path


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return random_policy(tmp_path_factory.mktemp("standin") / "policy")


def test_the_standin_holds_no_glm5_serving_code():
    """The stand-in's module imports nothing of glm5_core but glm5_core.model (the forward pass)."""
    import ast
    import pathlib

    import tests.rl.serving.sglang_standin as standin

    tree = ast.parse(pathlib.Path(standin.__file__).read_text())
    imported = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    ours = sorted(m for m in imported if m.split(".")[0] == "glm5_core")
    assert ours and all(m == "glm5_core.model" for m in ours), ours


def test_the_standin_answers_as_each_sglang_version_does(policy):
    """SGLang's bodies, its request contract, and its scheduler refusing a flush with requests running."""
    for version in ("0.5.23", "0.5.15.post1"):
        server = StandInProcess(policy, sglang_version=version, api_key=KEY)
        try:
            client = EngineClient(server.url, api_key=KEY)
            assert client.health() and EngineClient(server.url).health()  # an empty 200, no key needed
            assert client.info()["weight_version"] == "default" and "busy_seconds" not in client.info()
            assert client.flush_cache().startswith("Cache flushed.")  # plain text
            resp = client.generate({"input_ids": [40, 41], "return_logprob": True, "not_a_field": 1,  # ignored
                                    "sampling_params": {"max_new_tokens": 5, "temperature": 1.0}})
            meta = resp["meta_info"]
            assert "text" not in resp and len(resp["output_ids"]) == 5 and meta["finish_reason"]["type"] == "length"
            assert [t for _, t, _ in meta["output_token_logprobs"]] == resp["output_ids"]
            assert ("weight_versions" in meta) == (version == "0.5.23")  # 0.5.15 has no per-token spans
            default = client.generate({"input_ids": [40] * 60, "sampling_params": {"temperature": 0}})
            assert len(default["output_ids"]) == 4  # max_new_tokens 128 (> 4), cut at the context length (64)
            with pytest.raises(EngineRequestError) as err:  # unknown sampling keys are refused
                client.generate({"input_ids": [40], "sampling_params": {"max_tokens": 3}})
            assert err.value.status == (400 if version == "0.5.23" else 500)
            if version == "0.5.23":
                assert "unknown field `max_tokens`" in str(err.value)
            with pytest.raises(EngineRequestError, match="vocab size") as err:
                client.generate({"input_ids": [10**6]})
            assert err.value.status == 400
            with pytest.raises(EngineRequestError, match="Unauthorized") as err:
                EngineClient(server.url).info()
            assert err.value.status == 401
            with pytest.raises(EngineRequestError) as err:
                client.end_trajectories(["x"])
            assert err.value.status == 404
            with pytest.raises(EngineRequestError) as err:  # 0.5.23: only inside a session; 0.5.15: no group
                client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[264, 128]], "g", 1)
            assert err.value.status == 400 and ((NO_SESSION in str(err.value)) == (version == "0.5.23"))
            if version == "0.5.15.post1":
                with pytest.raises(EngineRequestError) as err:
                    client.begin_weight_update()
                assert err.value.status == 404
            assert server.state()["glm5_rl_modules"] == []  # nothing of glm5_core.rl was imported
            refuses_a_flush_with_requests_running(server, client, policy, version)
        finally:
            server.shutdown()


def refuses_a_flush_with_requests_running(server, client, policy, version):
    """In-place pause with a request mid-generation, then an update that flushes: 0.5.23 answers 400 with its
    message (the weights were loaded), 0.5.15.post1's scheduler asserts and the server is gone."""
    answer = {}

    def ask():
        try:
            answer["r"] = client.generate({"input_ids": [40, 41], "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}})
        except EngineUnavailable as exc:  # 0.5.15: the connection goes with the server
            answer["error"] = exc

    worker = threading.Thread(target=ask)
    worker.start()
    while not server.state()["running"]:  # in the running batch, mid-generation
        pass
    client.pause_generation("in_place")  # requests keep their place in the running batch
    if version == "0.5.23":
        with pytest.raises(EngineRequestError, match="cache was not flushed") as err:
            client.update_weights_from_disk(str(policy), 1)
        assert err.value.status == 400 and server.state()["weight_version"] == "1"  # loaded, not flushed
        with pytest.raises(EngineRequestError):
            client.flush_cache()
        client.continue_generation()
        worker.join(60)
        assert len(answer["r"]["output_ids"]) == 24
        client.flush_cache()  # idle now
    else:
        with pytest.raises(EngineUnavailable):
            client.update_weights_from_disk(str(policy), 1)
        worker.join(60)
        server.proc.wait(30)
        assert not server.alive() and "Cache flush failed" in server.stderr() and "error" in answer


def rl_config(tmp_path, weight_sync, mode, *, max_new_tokens=4, max_steps=3):
    cfg = {
        "seed": 0, "mode": mode, "output_dir": str(tmp_path / "run"), "max_minutes": 5, "max_steps": max_steps,
        "env": {"name": "arithmetic", "max_operand": 2, "template": "{a}+{b}=", "max_new_tokens": max_new_tokens},
        "model": {"preset": "tiny", "overrides": {"index_topk": 8, "max_position_embeddings": 64}},
        "rollout": {"max_batch": 8, "max_len": 32, "group_size": 2, "max_inflight_groups": 2,
                    "max_buffered": 64 if mode == "async" else 8, "episode_threads": 8,
                    "weight_sync": weight_sync, "sync_bucket_mb": 0.25},
        "train": {"batch_size": 4, "max_staleness": 4, "optim": {"lr": 1e-4}},
        "eval": {"every": 0, "samples_per_problem": 1},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# every pair of (mode, weight sync, SGLang version) once: CI runs each case (slow ones too), ~10 s apiece
# every pair of (mode, weight sync, SGLang version) once: CI runs each case (slow ones too), ~10 s apiece; in the
# last, the server is restarted after the first push (it boots other weights, as a restarted SGLang does)
CASES = [("async", "disk", "0.5.23", False), ("async", "distributed", "0.5.15.post1", False),
         ("sync", "distributed", "0.5.23", False), ("sync", "disk", "0.5.15.post1", True)]


@pytest.mark.parametrize("mode,weight_sync,version,restart", CASES)
def test_rl_with_multi_token_answers_through_weight_pushes(policy, tmp_path, mode, weight_sync, version, restart,
                                                           capsys):
    """4-token answers, 3 steps, a push after each (async: the producer never stops, so requests are
    mid-generation at the pushes): every push must pause in a mode after which SGLang's scheduler can flush
    (0.5.23 answers 400 otherwise, 0.5.15's scheduler dies), distributed pushes run in 0.5.23's session (and
    without one on 0.5.15), and the engine ends with the trainer's last weights, bit for bit. A restarted server
    gets a catch-up push before it takes work (else its answers carry an unknown version and are dropped)."""
    from urllib.parse import urlparse

    from safetensors.torch import load_file

    servers = [StandInProcess(policy, sglang_version=version, api_key=KEY)]

    def restart_after_the_first_push():
        while servers[0].alive() and servers[0].state()["weight_version"] != "1":
            time.sleep(0.05)
        servers[0].shutdown()
        servers.append(StandInProcess(policy, sglang_version=version, api_key=KEY,
                                      port=urlparse(servers[0].url).port))

    restarter = threading.Thread(target=restart_after_the_first_push, daemon=True)
    if restart:
        restarter.start()
    try:
        rc = main(["rl", "--config", str(rl_config(tmp_path, weight_sync, mode)), "--engine-url", servers[0].url,
                   "--api-key", KEY, "--backend", "cpu"])
        out, err = capsys.readouterr()
        assert rc == 0, err[-3000:] + servers[-1].stderr()[-2000:]
        restarter.join(60) if restart else None
        server = servers[-1]
        state = server.state()
        server.save_weights(tmp_path / "engine.safetensors")
    finally:
        for server in servers:
            server.shutdown()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["producer_errors"] == [] and summary["dropped_malformed"] == 0
    assert summary["trained_trajectories"] >= 12 and summary["failed_pushes"] == 0
    if mode == "async":  # generations were aborted by the pushes and continued (10-12 in a run)
        assert summary["continued_generations"] > 0
    assert summary["weight_sync"] == weight_sync and len(summary["weight_sync_s"]) == 4  # initial + 3 pushes
    assert state["refused_flushes"] == 0 and state["weight_version"] == "3" and not state["session"]
    calls = state["calls"]
    update = "/update_weights_from_disk" if weight_sync == "disk" else "/update_weights_from_distributed"
    if restart:  # the new server: a catch-up load first (no pause: it has no work), then the later pushes
        assert len(servers) == 2 and summary["catch_up_pushes"] >= 1 and calls[0] == update, calls
    else:
        assert calls.count("/pause_generation") == calls.count("/continue_generation") == 4 and update in calls
        sessions = calls.count("/begin_weight_update"), calls.count("/end_weight_update")
        assert sessions == ((4, 4) if weight_sync == "distributed" and version == "0.5.23" else (0, 0)), sessions
    assert state["glm5_rl_modules"] == []
    trainer = load_file(str(tmp_path / "run" / "weights" / "v000003.safetensors"))
    engine = load_file(str(tmp_path / "engine.safetensors"))
    assert set(trainer) == set(engine) and all(torch.equal(trainer[k], engine[k]) for k in trainer)
