import json
import math
import os
import time
import urllib.error
import urllib.request

import pytest
import torch

from glm5_core.rl.serving.client import EngineClient, EngineRequestError
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import Limits, parse_generate_request
from glm5_core.rl.serving.server import EngineServer

LIMITS = Limits(vocab_size=100, max_input_tokens=10, max_new_tokens=5)


def test_parse_valid_request():
    req = parse_generate_request({"input_ids": [1, 99], "rid": "x", "return_logprob": True, "sampling_params": {
        "temperature": 0.5, "top_p": 0.9, "max_new_tokens": 5, "stop_token_ids": [3]}}, LIMITS)
    assert (req.input_ids, req.temperature, req.top_p, req.max_new_tokens, req.stop_token_ids) == \
        ([1, 99], 0.5, 0.9, 5, (3,))


@pytest.mark.parametrize("body,field", [
    ({"input_ids": [100]}, r"input_ids\[0\]"),
    ({"input_ids": [-1]}, r"input_ids\[0\]"),
    ({"input_ids": [1.0]}, r"input_ids\[0\]"),
    ({"input_ids": [True]}, r"input_ids\[0\]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": list(range(11))}, "input_ids"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 6}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [100]}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"beam_width": 2}}, "beam_width"),
    ({"input_ids": [1], "sampling_params": {"best_of": 2}}, "unknown"),  # not an SGLang sampling key: refused
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num"),
    ({"input_ids": [[1], [2]], "rid": "a"}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "rid"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "hi"}, "text"),
    ([1, 2], "request"),
])
def test_parse_rejects_bad_requests(body, field):
    with pytest.raises(ValueError, match=field):
        parse_generate_request(body, LIMITS)


@pytest.fixture(scope="module")
def served(tiny_policy, tmp_path_factory):
    weights_dir = str(tmp_path_factory.mktemp("weights"))
    engine = RolloutEngine(tiny_policy, max_batch=4, max_len=64)
    server = EngineServer(engine, weights_dir=weights_dir, max_body_bytes=4096).start()
    yield server, weights_dir
    server.shutdown()


def test_server_binds_localhost_and_generates_sglang_shape(served):
    server, _ = served
    assert server._httpd.server_address[0] == "127.0.0.1"
    client = EngineClient(server.url)
    resp = client.generate({"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0},
                            "return_logprob": True, "rid": "a"})
    meta = resp["meta_info"]
    assert len(resp["output_ids"]) == meta["completion_tokens"] <= 4
    assert [e[1] for e in meta["output_token_logprobs"]] == resp["output_ids"]
    assert all(e[0] <= 0.0 for e in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["weight_version"] == "0" and meta["prompt_tokens"] == 3  # SGLang's weight_version is a str
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": len(resp["output_ids"])}]


def test_server_rejects_bad_requests_with_400_and_oversized_with_413(served):
    server, _ = served
    client = EngineClient(server.url)
    with pytest.raises(EngineRequestError, match="input_ids") as err:
        client.generate({"input_ids": [10**6]})
    assert err.value.status == 400
    with pytest.raises(EngineRequestError) as err:
        client.generate({"input_ids": [1] * 3000})
    assert err.value.status == 413
    req = urllib.request.Request(server.url + "/generate", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(req, timeout=10)
    assert http_err.value.code == 400


def test_weight_update_only_from_the_weights_dir(served, tiny_policy, tmp_path):
    from safetensors.torch import save_file

    server, weights_dir = served
    client = EngineClient(server.url)
    state = {k: v.detach().clone().contiguous() for k, v in tiny_policy.state_dict().items()}
    outside = str(tmp_path / "v1.safetensors")
    save_file(state, outside)
    with pytest.raises(EngineRequestError, match="model_path"):
        client.update_weights_from_disk(outside, 1)
    inside = os.path.join(weights_dir, "v1.safetensors")
    save_file(state, inside)
    assert client.update_weights_from_disk(inside, 1)["success"]
    resp = client.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True})
    assert resp["meta_info"]["weight_version"] == "1"
    bad = dict(state)
    bad.pop(next(iter(bad)))
    save_file(bad, os.path.join(weights_dir, "v2.safetensors"))
    with pytest.raises(EngineRequestError, match="missing"):
        client.update_weights_from_disk(os.path.join(weights_dir, "v2.safetensors"), 2)


def test_weight_update_rejects_older_versions_non_finite_and_unreadable_files_with_400(served, tiny_policy):
    from safetensors.torch import save_file

    server, weights_dir = served
    client = EngineClient(server.url)
    state = {k: v.detach().clone().contiguous() for k, v in tiny_policy.state_dict().items()}
    current = os.path.join(weights_dir, "v7.safetensors")
    save_file(state, current)
    assert client.update_weights_from_disk(current, 7)["success"]
    assert client._call("GET", "/get_weight_version") == {"weight_version": "7"}
    with pytest.raises(EngineRequestError, match="weight_version") as err:
        client.update_weights_from_disk(current, 6)  # versions only move forward
    assert err.value.status == 400
    name = next(k for k, v in state.items() if v.is_floating_point())
    poisoned = dict(state, **{name: torch.full_like(state[name], float("nan"))})
    save_file(poisoned, os.path.join(weights_dir, "v8.safetensors"))
    with pytest.raises(EngineRequestError, match="finite") as err:
        client.update_weights_from_disk(os.path.join(weights_dir, "v8.safetensors"), 8)
    assert err.value.status == 400
    with open(os.path.join(weights_dir, "v9.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    with pytest.raises(EngineRequestError, match="cannot read") as err:
        client.update_weights_from_disk(os.path.join(weights_dir, "v9.safetensors"), 9)
    assert err.value.status == 400
    resp = client.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True})
    assert resp["meta_info"]["weight_version"] == "7" and all(math.isfinite(e[0]) for e in
                                                            resp["meta_info"]["output_token_logprobs"])


def test_client_refuses_remote_urls_unless_listed_explicitly():
    with pytest.raises(ValueError, match="url.*loopback"):
        EngineClient("http://10.0.0.1:80")
    assert EngineClient("http://10.0.0.1:80", allow_remote=True).url == "http://10.0.0.1:80"  # no request made
    assert EngineClient("http://127.0.0.2:80/").url == "http://127.0.0.2:80"
    for bad in ("https://127.0.0.1:80", "http://127.0.0.1", "http://127.0.0.1:80/generate", "127.0.0.1:80"):
        with pytest.raises(ValueError, match="url"):
            EngineClient(bad, allow_remote=True)


def test_end_trajectories_frees_prefix_cache_entries_and_validates(served):
    server, _ = served
    client = EngineClient(server.url)
    for rid in ("keep", "done1", "done2"):
        client.generate({"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 2}, "rid": rid})
    cache = server.engine.prefix_cache
    assert all(cache.lookup(rid, [7, 8, 9, 1])[1] is not None for rid in ("keep", "done1", "done2"))
    assert client.end_trajectories(["done1", "done2", "never-seen"]) == {"success": True, "ended": 3}
    assert cache.lookup("keep", [7, 8, 9, 1])[1] is not None
    assert cache.lookup("done1", [7, 8, 9, 1])[1] is None and cache.lookup("done2", [7, 8, 9, 1])[1] is None
    for body in ({"rids": "done1"}, {"rids": [1, 2]}, ["done1"]):
        req = urllib.request.Request(server.url + "/end_trajectories", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=10)
        assert http_err.value.code == 400 and b"rids" in http_err.value.read()


def test_trajectory_closer_sends_in_batches_and_flushes_the_rest():
    import threading

    from glm5_core.rl.fleet.replicas import TrajectoryCloser

    sent = []
    closer = TrajectoryCloser(sent.append, batch=4)
    threads = [threading.Thread(target=lambda i=i: closer.add(f"t{i}")) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(batch) for batch in sent] == [4, 4]
    closer.flush()
    assert sorted(sum(sent, [])) == sorted(f"t{i}" for i in range(10)) and len(sent[-1]) == 2
    with pytest.raises(ValueError, match="batch"):
        TrajectoryCloser(sent.append, batch=0)


# -- what an SGLang client expects of glm5 serve (SGLang 0.5.23: api/v1/api_types.py, http_server.py) ----------
def _post(url, route, body):
    request = urllib.request.Request(url + route, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read()
        return response.status, (json.loads(raw) if raw else None)


def test_answers_meet_sglangs_response_contract(served):
    from tests.rl.serving.sglang_contract import ContractError, generate_response

    server, _ = served
    with pytest.raises(ContractError, match="expected a string"):  # the checker catches what we used to send
        generate_response({"text": None, "output_ids": [1], "meta_info": {}})
    _, answer = _post(server.url, "/generate", {"input_ids": [10, 11], "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 3}})
    generate_response(answer)
    assert "text" not in answer  # token-in-token-out, as SGLang with skip_tokenizer_init


@pytest.fixture(scope="module")
def long_policy():
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    torch.manual_seed(0)
    return GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, max_position_embeddings=512)).eval()


def test_sglang_defaults_batches_and_generate_req_input_fields(long_policy):
    from tests.rl.serving.sglang_contract import generate_response

    engine = RolloutEngine(long_policy, max_batch=4, max_len=256)
    server = EngineServer(engine).start()
    try:
        # SGLang's default max_new_tokens is 128; ignore_eos: the engine runs to the length without stop tokens
        _, one = _post(server.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"ignore_eos": True}})
        assert one["meta_info"]["completion_tokens"] == 128 and one["meta_info"]["finish_reason"]["type"] == "length"
        # a batch: a list of answers in order, each with its rid; GenerateReqInput fields at their defaults and
        # unknown top-level keys are accepted (SGLang ignores them), the prompt's ids repeated when asked
        body = {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["r0", "r1"], "return_logprob": [True, False],
                "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}], "stream": False,
                "logprob_start_len": -1, "priority": 3, "routing_key": "k", "custom_labels": {"a": "b"},
                "some_future_field": 1, "return_prompt_token_ids": True}
        _, answers = _post(server.url, "/generate", body)
        assert [a["meta_info"]["id"] for a in answers] == ["r0", "r1"]
        assert [a["prompt_token_ids"] for a in answers] == [[1, 2, 3], [4, 5]]
        assert len(answers[0]["output_ids"]) <= 2 and len(answers[1]["output_ids"]) <= 3
        assert "output_token_logprobs" in answers[0]["meta_info"]
        assert "output_token_logprobs" not in answers[1]["meta_info"]
        for answer in answers:
            generate_response(answer)
        # 0.5.23's route names
        with urllib.request.urlopen(server.url + "/model_info", timeout=30) as r:
            info = json.loads(r.read())
        assert info["is_generation"] is True and info["weight_version"] == "0"
        with urllib.request.urlopen(server.url + "/server_info", timeout=30) as r:
            assert json.loads(r.read())["context_length"] == 256
    finally:
        server.shutdown()


def test_abort_request_ends_a_running_request_with_what_it_sampled(long_policy):
    import threading

    engine = RolloutEngine(long_policy, max_batch=2, max_len=512)
    server = EngineServer(engine).start()
    try:
        out = {}
        worker = threading.Thread(target=lambda: out.update(answer=_post(server.url, "/generate", {
            "input_ids": [1, 2], "rid": "long", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})[1]))
        worker.start()
        deadline = time.monotonic() + 60
        while engine.stats.generated_tokens < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, body = _post(server.url, "/abort_request", {"rid": "long"})
        assert status == 200 and body is None  # SGLang answers an empty 200
        worker.join(60)
        meta = out["answer"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 400
        assert _post(server.url, "/abort_request", {"rid": "nobody"})[0] == 200  # unknown: nothing to do
        with pytest.raises(urllib.error.HTTPError):
            _post(server.url, "/abort_request", {"rid": 3})
    finally:
        server.shutdown()
