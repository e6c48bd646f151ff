import json
import math
import os
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
    ({"input_ids": [1], "sampling_params": {"beam_width": 2}}, "unknown"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"input_ids": [1], "extra": 1}, "unknown"),
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
