"""glm5 rl against a server that answers as SGLang does (tests/rl/serving/sglang_standin.py): the client reads its
bodies, and a short run trains through both weight-sync paths with the engine's weights ending bitwise equal to
the trainer's last push."""
import json

import pytest
import torch
import yaml

from glm5_core.cli import main
from glm5_core.rl.serving.client import EngineClient, EngineRequestError
from glm5_core.rl.serving.engine import RolloutEngine
from tests.rl.serving.sglang_standin import SGLangStandIn

KEY = "s3cret"


@pytest.fixture
def standin(tmp_path):
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    torch.manual_seed(123)  # not the trainer's weights: the run must push its own before rolling out
    model = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8)).eval()
    server = SGLangStandIn(RolloutEngine(model, max_batch=8, max_len=64), "tiny-random", api_key=KEY).start()
    yield server
    server.shutdown()


def test_client_reads_sglang_bodies(standin):
    client = EngineClient(standin.url, api_key=KEY)
    assert client.health()  # an empty 200
    info = client.info()
    assert info["weight_version"] == "default" and "busy_seconds" not in info
    assert client.flush_cache().startswith("Cache flushed.")  # plain text
    resp = client.generate({"input_ids": [40, 41], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True})
    assert resp["meta_info"]["weight_version"] == "default" and "text" not in resp
    with pytest.raises(EngineRequestError, match="input_ids") as err:
        client.generate({"input_ids": [10**6]})
    assert err.value.status == 400  # {"error": {"message": ...}}
    with pytest.raises(EngineRequestError, match="Unauthorized") as err:
        EngineClient(standin.url).info()
    assert err.value.status == 401
    assert EngineClient(standin.url).health()  # /health needs no key
    with pytest.raises(EngineRequestError) as err:
        client.end_trajectories(["x"])
    assert err.value.status == 404


def rl_config(tmp_path, weight_sync, *, max_new_tokens=1, max_steps=2, max_buffered=8):
    cfg = {
        "seed": 0, "mode": "async", "output_dir": str(tmp_path / "run"), "max_minutes": 5, "max_steps": max_steps,
        "env": {"name": "arithmetic", "max_operand": 2, "template": "{a}+{b}=", "max_new_tokens": max_new_tokens},
        "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
        "rollout": {"max_batch": 8, "max_len": 32, "group_size": 2, "max_inflight_groups": 2,
                    "max_buffered": max_buffered, "episode_threads": 8, "weight_sync": weight_sync,
                    "sync_bucket_mb": 0.25},
        "train": {"batch_size": 4, "max_staleness": 4, "optim": {"lr": 1e-4}},
        "eval": {"every": 0, "samples_per_problem": 1},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("weight_sync", ["disk", "distributed"])
def test_glm5_rl_trains_against_sglang(standin, tmp_path, weight_sync, capsys):
    from safetensors.torch import load_file

    rc = main(["rl", "--config", str(rl_config(tmp_path, weight_sync)), "--engine-url", standin.url,
               "--api-key", KEY, "--backend", "cpu"])
    assert rc == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_trajectories"] == 8 and summary["producer_errors"] == []
    assert summary["rollout_idle_ratio"] is None  # SGLang reports no busy_seconds
    assert summary["weight_sync"] == weight_sync and len(summary["weight_sync_s"]) == 3  # initial + 2 pushes
    routes = [route for route, _ in standin.calls]
    update = "/update_weights_from_disk" if weight_sync == "disk" else "/update_weights_from_distributed"
    assert routes.count("/pause_generation") == routes.count("/continue_generation") == 3 and update in routes
    assert standin.args.weight_version == "2"  # the trainer's version, as SGLang's string
    trainer = load_file(str(tmp_path / "run" / "weights" / "v000002.safetensors"))
    engine = standin.engine.model.state_dict()
    assert set(trainer) == set(engine) and all(torch.equal(trainer[k], engine[k]) for k in trainer)


@pytest.mark.parametrize("sglang_version", ["0.5.23", "0.5.15.post1"])
def test_async_rl_with_multi_token_answers_through_weight_pushes(tmp_path, sglang_version, capsys):
    """Requests are mid-generation at the pushes (4-token answers; the producer never stops: max_buffered 64): the push
    must pause in a mode after which SGLang's scheduler can flush (0.5.23 answers 400 otherwise, 0.5.15 dies), and
    the aborted generations come back whole, their tokens stamped with the versions that sampled them."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    torch.manual_seed(123)
    model = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8)).eval()
    server = SGLangStandIn(RolloutEngine(model, max_batch=8, max_len=64), "tiny-random", api_key=KEY,
                           sglang_version=sglang_version).start()
    try:
        rc = main(["rl", "--config", str(rl_config(tmp_path, "disk", max_new_tokens=4, max_steps=3, max_buffered=64)),
                   "--engine-url", server.url, "--api-key", KEY, "--backend", "cpu"])
    finally:
        server.shutdown()
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())  # stdout ends with one human line
    assert summary["steps"] == 3 and summary["producer_errors"] == [] and summary["dropped_malformed"] == 0
    assert not server.dead and server.refused_flushes == 0 and server.args.weight_version == "3"
    assert len(summary["weight_sync_s"]) == 4  # initial + 3 pushes
    pauses = [body for route, body in server.calls if route == "/pause_generation"]
    assert len(pauses) == 4 and all(body.get("mode", "abort") == "abort" for body in pauses)


def test_the_standin_refuses_a_flush_with_requests_running_as_each_sglang_version_does(tmp_path):
    """In-place pause with a request mid-generation, then an update that flushes: 0.5.23 answers 400 with its
    message (the weights were loaded), 0.5.15.post1's scheduler asserts and the server is gone."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM, save_pretrained
    from glm5_core.rl.serving.client import EngineUnavailable

    torch.manual_seed(123)
    model = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8)).eval()
    save_pretrained(model, str(tmp_path / "hf"), transformers_form=False)
    for version in ("0.5.23", "0.5.15.post1"):
        server = SGLangStandIn(RolloutEngine(model, max_batch=8, max_len=64), "tiny-random",
                               sglang_version=version).start()
        client = EngineClient(server.url)
        try:
            import threading

            answer = {}

            def ask(answer=answer, client=client):
                try:
                    answer["r"] = client.generate({"input_ids": [40, 41], "return_logprob": True,
                                                   "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}})
                except EngineUnavailable as exc:  # 0.5.15: the connection goes with the server
                    answer["error"] = exc

            worker = threading.Thread(target=ask)
            worker.start()
            while not server._inflight:
                pass
            client.pause_generation("in_place")
            if version == "0.5.23":
                with pytest.raises(EngineRequestError, match="cache was not flushed") as err:
                    client.update_weights_from_disk(str(tmp_path / "hf"), 1)
                assert err.value.status == 400 and server.args.weight_version == "1"  # loaded, not flushed
                with pytest.raises(EngineRequestError):
                    client.flush_cache()
                client.continue_generation()
                worker.join(30)
                assert len(answer["r"]["output_ids"]) == 40
                client.flush_cache()  # idle now
            else:
                with pytest.raises(EngineUnavailable):
                    client.update_weights_from_disk(str(tmp_path / "hf"), 1)
                worker.join(30)
                assert server.dead and not client.health()
        finally:
            server.shutdown()
