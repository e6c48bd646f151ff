"""The malformed-answer table: an engine that answers 200 with something no correct engine sends (issue 33 item 3)
drops that rollout with one warning naming the engine's URL, counts it (``ReplicaSet.dropped_malformed``, the
run's ``dropped_malformed``), and never ends the run nor reaches the trainer. The engine is a real HTTP server
answering SGLang's ``/generate`` shape (``output_ids``, ``meta_info.output_token_logprobs`` ``[logprob, id, None]``,
``weight_version`` / ``weight_versions`` spans), corrupted for one trajectory only."""
import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from glm5_core.rl.fleet.executors.external import ExternalEngines
from glm5_core.rl.fleet.replicas import ReplicaSet
from glm5_core.rl.fleet.router import ConsistentHashRouter
from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv
from glm5_core.rl.rollout.response_check import ResponseCheck
from glm5_core.rl.rollout.runner import RolloutRunner
from glm5_core.rl.serving.client import EngineClient, MalformedResponse

VOCAB = 128
NEWEST = 1  # the newest version the trainer pushed


def answer(request):
    """A correct answer: two digit tokens sampled under version "1"."""
    ids = [48 + len(request["input_ids"]) % 10, 10]
    return {"output_ids": ids, "meta_info": {
        "id": request.get("rid"), "finish_reason": {"type": "stop", "matched": 10}, "weight_version": "1",
        "weight_versions": [{"version": "1", "start": 0, "end": len(ids)}],
        "output_token_logprobs": [[-0.25, t, None] for t in ids]}}


def _set(path, value):
    def corrupt(r):
        node = r
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return corrupt


def _oov(r):
    r["output_ids"][0] = VOCAB + 5
    r["meta_info"]["output_token_logprobs"][0][1] = VOCAB + 5


CORRUPTIONS = {
    "missing output_token_logprobs": lambda r: r["meta_info"].pop("output_token_logprobs"),
    "null log-prob": _set(("meta_info", "output_token_logprobs", 0, 0), None),
    "NaN log-prob": _set(("meta_info", "output_token_logprobs", 1, 0), math.nan),
    "positive log-prob": _set(("meta_info", "output_token_logprobs", 0, 0), 5.0),
    "fewer log-probs than tokens": lambda r: r["meta_info"]["output_token_logprobs"].pop(),
    "log-prob of another token": _set(("meta_info", "output_token_logprobs", 1, 1), 11),
    "token id outside the vocabulary": _oov,
    "negative token id": _set(("output_ids", 0), -3),
    "output_ids not ids": _set(("output_ids",), "12"),
    "unknown version label": lambda r: r["meta_info"].update(
        weight_version="latest", weight_versions=[{"version": "latest", "start": 0, "end": 2}]),
    "future version": lambda r: r["meta_info"].update(
        weight_version="7", weight_versions=[{"version": "7", "start": 0, "end": 2}]),
    "spans short of the output": _set(("meta_info", "weight_versions"), [{"version": "1", "start": 0, "end": 1}]),
}


class Engine:
    """/generate answers ``answer`` (corrupted by ``corrupt`` for trajectory ``bad``); /health 200."""

    def __init__(self, corrupt, bad):

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                return

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                response = answer(request)
                if request.get("rid") == bad:
                    corrupt(response)
                self._send(200, response)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_malformed_answer_drops_its_rollout_warns_and_counts(corruption, caplog):
    engine = Engine(CORRUPTIONS[corruption], bad="g0-1")
    replicas = ReplicaSet(ExternalEngines([engine.url]), ConsistentHashRouter(), ["engine0"], poll_seconds=60,
                          client_factory=EngineClient,
                          check_response=ResponseCheck(vocab_size=VOCAB, newest_version=lambda: NEWEST)).start()
    runner = RolloutRunner(ArithmeticEnv(max_operand=3, max_new_tokens=2), replicas.generate, group_size=2,
                           temperature=1.0, top_p=1.0, max_len=64, max_workers=2)
    try:
        with caplog.at_level(logging.WARNING):
            trajectories = {t.trajectory_id: t for t in runner.run_groups(2)}  # never raises
    finally:
        runner.shutdown()
        replicas.shutdown()
        engine.close()
    assert set(trajectories) == {"g0-0", "g0-1", "g1-0", "g1-1"}
    dropped = trajectories["g0-1"]
    assert dropped.env_failed and dropped.reward == 0.0  # env_failed groups never reach the trainer (buffer)
    assert all(v <= NEWEST and 0 <= t < VOCAB for s in dropped.samples for t, v in zip(s.tokens, s.versions))
    assert not any(trajectories[t].env_failed for t in ("g0-0", "g1-0", "g1-1"))
    assert replicas.dropped_malformed == 1
    assert runner.rollout_failures == 0 and runner.env_failures == 0  # its own count, not another failure's
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and engine.url in warnings[0] and "g0-1" in warnings[0], warnings


def test_the_check_passes_correct_answers_and_names_what_is_wrong():
    check = ResponseCheck(vocab_size=VOCAB, newest_version=lambda: NEWEST)
    request = {"input_ids": [1, 2, 3], "return_logprob": True}
    good = answer(request)
    check(request, good)
    check(request, {**good, "meta_info": {**good["meta_info"], "weight_version": "default",
                                          "weight_versions": [{"version": "default", "start": 0, "end": 2}]}})
    check({"input_ids": [1]}, {"output_ids": [5], "meta_info": {"weight_version": "default"}})  # no log-probs asked
    tiny = answer(request)
    tiny["meta_info"]["output_token_logprobs"][0][0] = 1e-6  # float32 rounding above 0 is not an impossibility
    check(request, tiny)
    bad = answer(request)
    bad["meta_info"]["output_token_logprobs"][0][0] = 5.0
    with pytest.raises(MalformedResponse, match=r"output_token_logprobs\[0\].*<= 0, got 5.0"):
        check(request, bad)
    with pytest.raises(ValueError, match="vocab_size"):
        ResponseCheck(vocab_size=0, newest_version=lambda: 0)
