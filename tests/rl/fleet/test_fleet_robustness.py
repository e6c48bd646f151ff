"""Fault handling of the rollout fleet: the HTTP server (health of a failed engine, stalled clients, connection
cap, engine timeouts), the replica supervisor and request retries, the best-effort trajectory closer, and local
worker processes (failed starts, orphaned workers, boot weights pruned before a restart)."""
import inspect
import json
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from glm5_core.rl.fleet.executors.boot_weights import BootWeights, boot_path
from glm5_core.rl.fleet.replicas import ReplicaSet, TrajectoryCloser
from glm5_core.rl.fleet.router import ConsistentHashRouter
from glm5_core.rl.serving.client import EngineClient, EngineRequestError, EngineUnavailable
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.server import EngineServer
from glm5_core.rl.serving.worker import WorkerSpec, exit_with_parent

GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


def tiny_config():
    from glm5_core.model import GLM5Config

    return GLM5Config.tiny(num_hidden_layers=2, indexer_types=["full", "shared"], num_nextn_predict_layers=0,
                           index_topk=8, max_position_embeddings=64)


@pytest.fixture(scope="module")
def small_policy():
    from glm5_core.model import GLM5ForCausalLM

    torch.manual_seed(0)
    return GLM5ForCausalLM(tiny_config()).eval()


@pytest.fixture
def make_server(small_policy):
    servers = []

    def make(**kwargs):
        server = EngineServer(RolloutEngine(small_policy, max_batch=2, max_len=64), **kwargs).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()


def wait_until(predicate, timeout=10.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def raw_get(server, path):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    body = data.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(body) if body else None


# -- server -------------------------------------------------------------------------------------------------
def test_failed_engine_reports_503_on_health_and_generate(make_server):
    server = make_server()
    client = EngineClient(server.url, timeout=20)
    assert raw_get(server, "/health") == (200, None) and client.health()  # SGLang: an empty 200

    def poisoned_forward(*args, **kwargs):
        raise FloatingPointError("poisoned step")

    server.engine._forward = poisoned_forward  # the next scheduler step fails
    with pytest.raises(EngineRequestError, match="poisoned step") as err:
        client.generate(GENERATE)
    assert err.value.status == 500  # the request ran and failed inside the engine
    status, body = raw_get(server, "/health")
    assert status == 503 and "FloatingPointError: poisoned step" in body["error"]
    assert not client.health()
    with pytest.raises(EngineRequestError, match="poisoned step") as err:
        client.generate(GENERATE)
    assert err.value.status == 503 and not err.value.busy  # never reached the engine: safe to send elsewhere


def test_a_stalled_client_is_dropped_and_frees_its_thread(make_server):
    server = make_server(socket_timeout=0.5, max_connections=1)
    stalled = socket.create_connection(("127.0.0.1", server.port))
    stalled.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{\"input_ids\": [")
    stalled.settimeout(10)
    try:
        assert stalled.recv(10) == b""  # the server closed the connection (no reply to a half-sent request)
    finally:
        stalled.close()
    assert wait_until(lambda: server._httpd.open_connections == 0)  # the only handler slot is free again
    idle = socket.create_connection(("127.0.0.1", server.port))  # connects, never sends anything
    idle.settimeout(10)
    try:
        assert idle.recv(10) == b""
    finally:
        idle.close()


def test_connections_past_the_cap_get_a_busy_503_at_once(make_server):
    server = make_server(socket_timeout=20, max_connections=2)
    holders = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply and b"server busy" in reply
        assert server._httpd.rejected_connections == 1 and server._httpd.open_connections == 2
    finally:
        for sock in holders:
            sock.close()
    assert wait_until(lambda: server._httpd.open_connections == 0)  # closed connections give their slots back
    assert len(EngineClient(server.url).generate(GENERATE)["output_ids"]) == 2


def test_client_reads_a_busy_503_as_retry_later_and_as_alive():
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Busy(BaseHTTPRequestHandler):
        def _busy(self):
            body = b'{"error": "server busy"}'
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _busy

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = EngineClient(f"http://127.0.0.1:{httpd.server_address[1]}")
        with pytest.raises(EngineRequestError, match="busy") as err:
            client.generate(GENERATE)
        assert err.value.busy and err.value.retry_after == 1.0
        assert client.health()  # busy is alive: a supervisor must not replace it
        assert not EngineRequestError(503, "engine failed").busy
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_request_the_engine_does_not_finish_in_time_is_a_504(make_server):
    server = make_server(request_timeout=0.2)
    original = server.engine._forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.5)
        return original(*args, **kwargs)

    server.engine._forward = slow_forward
    with pytest.raises(EngineRequestError, match="not finished within") as err:
        EngineClient(server.url).generate(GENERATE)
    assert err.value.status == 504
    server.engine._forward = original


@pytest.mark.parametrize("kwargs,field", [({"socket_timeout": 0}, "socket_timeout"),
                                          ({"max_connections": 0}, "max_connections"),
                                          ({"max_connections": True}, "max_connections")])
def test_server_limits_are_validated(small_policy, kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineServer(RolloutEngine(small_policy, max_batch=1, max_len=64), **kwargs)


# -- replica set --------------------------------------------------------------------------------------------
class FakeExecutor:
    """Workers that are 'alive' until told otherwise; the first ``failing_restarts`` restarts raise."""

    def __init__(self, failing_restarts=0):
        self.alive = {}
        self.restarts = 0
        self.failing_restarts = failing_restarts

    def start(self, name):
        self.alive[name] = True
        return "http://127.0.0.1:9"

    def is_alive(self, name):
        return self.alive[name]

    def restart(self, name):
        self.restarts += 1
        if self.restarts <= self.failing_restarts:
            raise RuntimeError(f"engine worker {name} failed to start: FileNotFoundError: v000003.safetensors")
        return self.start(name)

    def shutdown(self):
        pass


class ScriptedClient:
    """Answers ``generate`` with the next scripted outcome (an exception to raise, or a response)."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0
        self.ended = []

    def generate(self, request):
        self.calls += 1
        outcome = self.outcomes[min(self.calls, len(self.outcomes)) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def end_trajectories(self, rids, timeout=None):
        self.ended.append(list(rids))

    def health(self, timeout=2.0):
        return True


def replica_set(clients, **kwargs):
    router = ConsistentHashRouter(list(clients))
    replicas = ReplicaSet(None, router, list(clients), poll_seconds=0.01, **kwargs)
    replicas.clients = dict(clients)
    return replicas


def test_supervisor_survives_failed_restarts_and_retries_with_backoff(caplog):
    executor = FakeExecutor(failing_restarts=2)
    replicas = ReplicaSet(executor, ConsistentHashRouter(), ["engine0"], poll_seconds=0.02).start()
    try:
        executor.alive["engine0"] = False  # the worker dies
        assert wait_until(lambda: replicas.replacements == 1, timeout=10)
        assert replicas._thread.is_alive() and executor.restarts == 3 and replicas.failed_restarts == 2
        assert replicas.router.healthy_replicas() == ["engine0"]
        assert "v000003.safetensors" in caplog.text and "replacement failed" in caplog.text
    finally:
        replicas.shutdown()


def test_a_4xx_is_never_resent():
    bad = EngineRequestError(400, "input_ids[0]: expected a token id")
    clients = {"a": ScriptedClient(bad), "b": ScriptedClient(bad)}
    replicas = replica_set(clients)
    with pytest.raises(EngineRequestError, match="input_ids"):
        replicas.generate("t0", GENERATE)
    assert clients["a"].calls + clients["b"].calls == 1
    assert replicas.router.healthy_replicas() == ["a", "b"] and replicas.failed_requests == 0


def test_a_poisoned_request_reaches_at_most_max_server_errors_replicas():
    clients = {n: ScriptedClient(EngineRequestError(500, "FloatingPointError: poisoned")) for n in "abcd"}
    replicas = replica_set(clients, max_server_errors=2, retry_timeout=2.0)
    with pytest.raises(EngineRequestError, match="poisoned"):
        replicas.generate("t0", GENERATE)
    assert sum(c.calls for c in clients.values()) == 2
    assert len(replicas.router.healthy_replicas()) == 2 and replicas.failed_requests == 2
    with pytest.raises(ValueError, match="max_server_errors"):
        replica_set(clients, max_server_errors=0)


def test_an_unavailable_engine_is_left_without_counting_against_the_request():
    ok = {"output_ids": [5], "meta_info": {}}
    clients = {"a": ScriptedClient(EngineRequestError(503, "engine scheduler failed")),
               "b": ScriptedClient(EngineUnavailable("connection refused")),
               "c": ScriptedClient(ok)}
    replicas = replica_set(clients, max_server_errors=1)
    key = next(f"t{i}" for i in range(1000) if replicas.router._walk(f"t{i}") == ["a", "b", "c"])
    assert replicas.generate(key, GENERATE) == ok
    assert replicas.router.healthy_replicas() == ["c"] and replicas.failed_requests == 2


def test_a_slow_replica_stays_on_the_ring_after_a_504():
    ok = {"output_ids": [5], "meta_info": {}}
    slow = ScriptedClient(EngineRequestError(504, "request t0: not finished within 600s"), ok)
    replicas = replica_set({"a": slow}, max_server_errors=2)
    replicas.router.acquire("t1")  # another trajectory pinned to the slow replica keeps its pin (and cache)
    assert replicas.generate("t0", GENERATE) == ok
    assert replicas.router.healthy_replicas() == ["a"] and replicas.failed_requests == 1
    assert replicas.router.live_trajectories() == {"a": 2}


def test_a_client_waits_longer_than_the_server_so_a_slow_request_comes_back_as_its_504():
    server_timeout = inspect.signature(EngineServer.__init__).parameters["request_timeout"].default
    assert EngineClient("http://127.0.0.1:9").timeout > server_timeout


def test_a_busy_replica_is_retried_in_place():
    ok = {"output_ids": [5], "meta_info": {}}
    busy = ScriptedClient(EngineRequestError(503, "server busy", retry_after=0.05), ok)
    replicas = replica_set({"a": busy})
    assert replicas.generate("t0", GENERATE) == ok
    assert busy.calls == 2 and replicas.router.healthy_replicas() == ["a"]


def test_failed_requests_are_counted_exactly_under_concurrency():
    ok = {"output_ids": [5], "meta_info": {}}

    class FailsFirstAttempt(ScriptedClient):
        def __init__(self):
            super().__init__(ok)
            self.seen = set()
            self.lock = threading.Lock()

        def generate(self, request):
            with self.lock:
                first = request["rid"] not in self.seen
                self.seen.add(request["rid"])
            if first:
                raise EngineUnavailable("reset")
            return ok

    class StickyRouter:  # one replica that never leaves the ring
        def acquire(self, key):
            return "a"

        def release(self, key, name):
            pass

        def mark_unhealthy(self, name):
            pass

    replicas = ReplicaSet(None, StickyRouter(), ["a"], poll_seconds=0.01)
    replicas.clients = {"a": FailsFirstAttempt()}
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=lambda i=i: [replicas.generate("t", dict(GENERATE, rid=f"{i}-{j}"))
                                                        for j in range(100)]) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(previous)
    assert replicas.failed_requests == 800


def test_trajectory_closer_does_not_hang_on_a_silent_replica():
    silent = socket.socket()  # listens (connections complete in the backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        skipped = ScriptedClient()
        replicas = replica_set({"hung": EngineClient(f"http://127.0.0.1:{silent.getsockname()[1]}"),
                                "down": skipped, "fine": ScriptedClient()}, end_trajectories_timeout=0.3)
        replicas.router.mark_unhealthy("down")
        closer = TrajectoryCloser(replicas.end_trajectories, batch=1)
        episode = threading.Thread(target=closer.add, args=("t0",), daemon=True)
        episode.start()
        episode.join(timeout=15)
        assert not episode.is_alive(), "the episode thread waits on a replica that never answers"
        assert replicas.clients["fine"].ended == [["t0"]] and skipped.ended == []
    finally:
        silent.close()


# -- boot weights -------------------------------------------------------------------------------------------
def test_boot_weights_pin_a_hard_link_that_outlives_pruning(tmp_path):
    source = tmp_path / "v000003.safetensors"
    source.write_bytes(b"weights-v3")
    spec = WorkerSpec({}, str(source), 3, str(tmp_path))
    boot = BootWeights()
    pinned = boot.pin("engine0", lambda name: spec)
    assert pinned.weights_path == boot_path(str(tmp_path), "engine0") and pinned.weight_version == 3
    assert os.stat(pinned.weights_path).st_ino == os.stat(source).st_ino
    source.unlink()  # the trainer prunes it
    assert open(pinned.weights_path, "rb").read() == b"weights-v3"
    boot.remove_all()
    assert not os.path.exists(pinned.weights_path)
    with pytest.raises(ValueError, match="name"):
        boot.pin("../evil", lambda name: spec)


def test_boot_weights_ask_again_then_fall_back_to_the_newest_pin(tmp_path):
    (tmp_path / "v000001.safetensors").write_bytes(b"v1")
    (tmp_path / "v000002.safetensors").write_bytes(b"v2")
    asked = []

    def spec_fn(name):  # the first answer names a file pruned meanwhile; the next one the current file
        asked.append(name)
        version = 1 if len(asked) == 1 else 2
        path = tmp_path / ("v000000.safetensors" if len(asked) == 2 else f"v00000{version}.safetensors")
        return WorkerSpec({}, str(path), version, str(tmp_path))

    boot = BootWeights()
    assert boot.pin("engine0", spec_fn).weight_version == 1
    assert boot.pin("engine1", spec_fn).weight_version == 2 and len(asked) == 3  # asked again once
    gone = lambda name: WorkerSpec({}, str(tmp_path / "v000009.safetensors"), 9, str(tmp_path))  # noqa: E731
    fallback = boot.pin("engine2", gone)
    assert (fallback.weight_version, open(fallback.weights_path, "rb").read()) == (2, b"v2")
    with pytest.raises(FileNotFoundError, match="weights_path"):
        BootWeights().pin("engine0", gone)


# -- local worker processes ---------------------------------------------------------------------------------
def test_watchdog_fires_only_when_the_parent_changes():
    fired = threading.Event()
    exit_with_parent(os.getppid(), poll_seconds=0.01, on_orphaned=fired.set)
    assert not fired.wait(0.2)
    exit_with_parent(os.getpid(), poll_seconds=0.01, on_orphaned=fired.set)  # we are not our own parent
    assert fired.wait(5)
    with pytest.raises(ValueError, match="parent_pid"):
        exit_with_parent(0)


class _ExitWhenUnpickled:
    """Kills the spawned worker while it unpickles its arguments, before it can report (like an OOM kill)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_worker_that_dies_before_reporting_is_a_failed_start(tmp_path):
    from glm5_core.rl.fleet.executors.local import LocalProcessExecutor

    (tmp_path / "v000000.safetensors").write_bytes(b"unused")
    spec = WorkerSpec({"poison": _ExitWhenUnpickled()}, str(tmp_path / "v000000.safetensors"), 0, str(tmp_path))
    executor = LocalProcessExecutor(lambda name: spec, start_timeout=120)
    with pytest.raises(RuntimeError, match=r"exited \(exit code 3\) before reporting"):
        executor.start("engine0")
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("rl-engine")]  # reaped
    executor.shutdown()


def save_tiny_weights(path):
    from safetensors.torch import save_file

    from glm5_core.model import GLM5ForCausalLM

    torch.manual_seed(0)
    save_file({k: v.contiguous() for k, v in GLM5ForCausalLM(tiny_config()).state_dict().items()}, str(path))


def test_a_restart_boots_although_its_weights_file_was_pruned(tmp_path):
    from glm5_core.rl.fleet.executors.local import LocalProcessExecutor

    weights = tmp_path / "v000000.safetensors"
    save_tiny_weights(weights)
    spec = WorkerSpec(tiny_config().to_hf_dict(), str(weights), 0, str(tmp_path), backend="cpu", max_batch=2,
                      max_len=64)
    executor = LocalProcessExecutor(lambda name: spec, start_timeout=120)
    try:
        first = EngineClient(executor.start("engine0")).generate(GENERATE)
        weights.unlink()  # pruned by save_weights(keep=3) while the fleet ran
        client = EngineClient(executor.restart("engine0"))
        assert client.info()["weight_version"] == "0"  # a string, as SGLang reports it
        assert client.generate(GENERATE)["output_ids"] == first["output_ids"]  # same weights, greedy
    finally:
        executor.shutdown()
    assert not os.path.exists(boot_path(str(tmp_path), "engine0"))


DRIVER_SCRIPT = """
import json, sys, time
from glm5_core.rl.fleet.executors.local import LocalProcessExecutor
from glm5_core.rl.serving.worker import WorkerSpec

if __name__ == "__main__":
    spec = WorkerSpec(**json.load(open(sys.argv[1])))
    executor = LocalProcessExecutor(lambda name: spec, start_timeout=120)
    executor.start("engine0")
    print(executor.pid("engine0"), flush=True)
    time.sleep(300)
"""


def process_gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_exits_when_its_driver_is_killed(tmp_path):
    weights = tmp_path / "v000000.safetensors"
    save_tiny_weights(weights)
    spec = dict(model_config=tiny_config().to_hf_dict(), weights_path=str(weights), weight_version=0,
                weights_dir=str(tmp_path), backend="cpu", max_batch=2, max_len=64)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "driver.py").write_text(DRIVER_SCRIPT)
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "spec.json")],
                              stdout=subprocess.PIPE, text=True)
    worker_pid = None
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 120)
        assert ready, "the driver did not start its worker"
        worker_pid = int(driver.stdout.readline())
        assert not process_gone(worker_pid)
        driver.send_signal(signal.SIGKILL)  # the driver dies without shutting its workers down
        driver.wait(timeout=10)
        assert wait_until(lambda: process_gone(worker_pid), timeout=20, step=0.1), "orphaned worker kept running"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if worker_pid is not None and not process_gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)
