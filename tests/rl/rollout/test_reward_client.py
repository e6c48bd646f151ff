"""The HTTP reward client against a tiny local reward server (a real socket on 127.0.0.1): replies,
retries with backoff on 5xx and time-outs, no retry on a malformed or oversized body, and the failure
policy of ``reward.on_failure``."""
import http.server
import json
import threading
import time

import pytest

from glm5_core.config_schema import ConfigError
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv
from glm5_core.rl.rollout.reward_client import HttpRewardClient, RewardRequestError, check_reward_url
from glm5_core.rl.rollout.rewards import RewardError, RewardScorer, build_reward
from glm5_core.rl.rollout.runner import RolloutRunner
from tests.rl.rollout.test_rollout_failures import fake_generate


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: bytes, headers=()):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        server = self.server
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.hits[self.path] = server.hits.get(self.path, 0) + 1
            hits = server.hits[self.path]
            server.payloads.append(payload)
            server.auth.append(self.headers.get("Authorization"))
        if self.path == "/ok":
            self._reply(200, json.dumps({"reward": len(payload["response_ids"]) / 2}).encode())
        elif self.path == "/flaky":  # two 500s, then an answer
            self._reply(500, b"busy") if hits <= 2 else self._reply(200, b'{"reward": 1}')
        elif self.path == "/500":
            self._reply(500, b"down")
        elif self.path == "/400":
            self._reply(400, b"bad request")
        elif self.path == "/slow":
            time.sleep(1.5)
            self._reply(200, b'{"reward": 1}')
        elif self.path == "/malformed":
            self._reply(200, b"reward=1")
        elif self.path == "/nan":
            self._reply(200, b'{"reward": NaN}')
        elif self.path == "/big":
            self._reply(200, b'{"reward": 1, "pad": "' + b"x" * 200_000 + b'"}')
        elif self.path == "/redirect":
            self._reply(307, b"", headers=[("Location", "/ok")])


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # the client of the slow reply hung up before it came: expected


@pytest.fixture(scope="module")
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.lock, srv.hits, srv.payloads, srv.auth = threading.Lock(), {}, [], []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def _client(server, path, **kwargs):
    delays = []
    kwargs.setdefault("timeout_s", 5.0)
    return HttpRewardClient(_url(server, path), sleep=delays.append, **kwargs), delays


PAYLOAD = {"trajectory_id": "t0", "response_ids": [1, 2, 3, 4]}


def test_a_reply_is_the_reward_and_the_api_key_is_sent(server):
    client, delays = _client(server, "/ok", api_key="secret")
    assert client(PAYLOAD) == 2.0
    assert server.payloads[-1] == PAYLOAD and server.auth[-1] == "Bearer secret" and delays == []


def test_a_500_is_retried_with_exponential_backoff(server):
    client, delays = _client(server, "/flaky", retries=2, backoff_s=0.25)
    assert client(PAYLOAD) == 1.0
    assert server.hits["/flaky"] == 3 and delays == [0.25, 0.5]


def test_a_server_that_keeps_failing_raises_after_the_retries(server):
    client, delays = _client(server, "/500", retries=3, backoff_s=0.1)
    with pytest.raises(RewardRequestError, match=r"HTTP 500 \(after 4 attempt\(s\)\)"):
        client(PAYLOAD)
    assert server.hits["/500"] == 4 and delays == [0.1, 0.2, 0.4]


def test_a_4xx_is_not_retried(server):
    client, delays = _client(server, "/400", retries=3)
    with pytest.raises(RewardRequestError, match=r"HTTP 400 \(after 1 attempt"):
        client(PAYLOAD)
    assert server.hits["/400"] == 1 and delays == []


def test_a_slow_reply_times_out_and_is_retried(server):
    client, delays = _client(server, "/slow", timeout_s=0.3, retries=1, backoff_s=0.0)
    with pytest.raises(RewardRequestError, match=r"timed out.*\(after 2 attempt"):
        client(PAYLOAD)
    assert delays == [0.0]


@pytest.mark.parametrize("path,message", [("/malformed", "malformed reply"), ("/nan", "malformed reply"),
                                          ("/big", "larger than max_response_bytes=4096"),
                                          ("/redirect", "HTTP 307")])
def test_a_malformed_oversized_or_redirected_reply_fails_without_retry(server, path, message):
    client, delays = _client(server, path, retries=2, max_response_bytes=4096)
    with pytest.raises(RewardRequestError, match=message):
        client(PAYLOAD)
    assert delays == [] and server.hits[path] == 1


def test_an_unreachable_server_is_a_failure_too():
    client = HttpRewardClient("http://127.0.0.1:9/score", retries=1, backoff_s=0.0, timeout_s=2.0,
                              sleep=lambda s: None)
    with pytest.raises(RewardRequestError, match=r"after 2 attempt"):
        client(PAYLOAD)


@pytest.mark.parametrize("url,message", [("ftp://host/score", "expected an http:// or https:// URL"),
                                         ("http:///score", "with a host"), ("http://u:p@host/", "no credentials"),
                                         ("http://host:99999/", "expected a port"), (5, "expected an http://")])
def test_reward_url_is_checked(url, message):
    with pytest.raises(ValueError, match=message) as info:
        check_reward_url(url)
    assert str(info.value).startswith("reward.url: ")


@pytest.mark.parametrize("reward,expected", [
    ({"url": "ftp://x/"}, "reward.url: expected an http:// or https:// URL"),
    ({"url": "http://127.0.0.1:1/", "timeout_s": 0}, "reward.timeout_s: expected a finite number > 0, got 0"),
    ({"url": "http://127.0.0.1:1/", "retries": -1}, "reward.retries: expected an int >= 0, got -1"),
    ({"url": "http://127.0.0.1:1/", "retry": 1}, "reward.retry: unknown key; did you mean 'retries'?"),
    ({"url": "http://127.0.0.1:1/", "on_failure": "ignore"}, "reward.on_failure: expected one of 'fail', 'zero'"),
    ({"url": "http://127.0.0.1:1/", "path": "a.b:c"}, "reward: expected a mapping with 'path'"),
    ({"path": "tests.rl.plugin_fixtures:length_reward", "scale": "x", "bad": 1}, "reward.path: "),
    ({"path": "tests.rl.plugin_fixtures:NOT_CALLABLE"}, "reward.path: "),
])
def test_each_bad_reward_section_is_one_line_naming_its_key(reward, expected, monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    with pytest.raises(ConfigError) as info:
        config_from_dict({"reward": reward})
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(expected), info.value.problems


def test_failure_policies():
    def broken(payload):
        raise RewardRequestError("reward server down")

    with pytest.raises(RewardError, match="reward failed for trajectory 't1': RewardRequestError: reward server down"):
        RewardScorer(broken, "fail")({"trajectory_id": "t1"})
    zero = RewardScorer(broken, "zero")
    assert zero({"trajectory_id": "t1"}) == 0.0 and zero.failures == 1
    drop = RewardScorer(broken, "drop")
    assert drop({"trajectory_id": "t1"}) is None and drop.failures == 1
    not_a_number = RewardScorer(lambda p: "high", "zero")
    assert not_a_number({}) == 0.0 and "expected a finite number" in not_a_number.last_error


def _run(env, reward):
    runner = RolloutRunner(env, fake_generate({}), group_size=2, temperature=1.0, top_p=1.0, max_len=64,
                           max_workers=2, reward_fn=reward)
    try:
        return runner, runner.run_groups(2)
    finally:
        runner.shutdown()


def test_the_runner_scores_with_the_reward_plugin_and_its_policy(server):
    env = ArithmeticEnv(max_operand=3, max_new_tokens=1, held_out=0.0)
    scorer = build_reward({"path": "tests.rl.plugin_fixtures:length_reward", "scale": 3.0})
    runner, trajectories = _run(env, scorer)
    assert [t.reward for t in trajectories] == [3.0] * 4  # one sampled token each, times 3
    scorer = build_reward({"url": _url(server, "/ok")})
    before = len(server.payloads)
    runner, trajectories = _run(env, scorer)
    assert [t.reward for t in trajectories] == [0.5] * 4
    sent = server.payloads[before:]
    assert sorted(p["trajectory_id"] for p in sent) == ["g0-0", "g0-1", "g1-0", "g1-1"]
    assert all(p["prompt"].endswith("=") and len(p["response_ids"]) == 1 for p in sent)
    dropped = build_reward({"url": _url(server, "/400"), "on_failure": "drop", "retries": 0})
    runner, trajectories = _run(env, dropped)
    assert all(t.env_failed for t in trajectories) and dropped.failures == 4 and runner.env_failures == 0
    failing = build_reward({"url": _url(server, "/400"), "retries": 0})
    with pytest.raises(RewardError, match="HTTP 400"):
        _run(env, failing)
