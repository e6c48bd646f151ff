"""Issue 19 item 10: a client trickling its request is dropped at the request deadline (so slow clients cannot
hold every slot), a generation whose client hung up is withdrawn from the engine, and deeply nested JSON is a
400, not a 500."""
import concurrent.futures
import json
import socket
import threading
import time

import pytest

from glm5_core.rl.serving.engine import EngineStats
from glm5_core.rl.serving.protocol import GenerateResult, Limits
from glm5_core.rl.serving.server import EngineServer


class NeverFinishingEngine:
    """Accepts requests and never finishes them; records which ones were withdrawn."""

    limits = Limits(vocab_size=100, max_input_tokens=10, max_new_tokens=5)
    version = newest_version = 0
    max_batch, max_len, failure, paused = 4, 16, None, False

    def __init__(self):
        self.aborted = []
        self.futures = []
        self.submitted = threading.Event()
        self.stats = EngineStats()

    def start(self):
        return self

    def shutdown(self):  # like RolloutEngine.shutdown: what is still running ends as an abort
        for future in self.futures:
            if not future.done():
                future.set_result(GenerateResult("x", [], [], [], "abort", 1, 0))

    def healthy(self):
        return True

    def submit(self, request):
        self.submitted.set()
        future = concurrent.futures.Future()
        self.futures.append(future)
        return future

    def abort(self, future):
        self.aborted.append(future)
        future.cancel()

    def num_active(self):
        return 0


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.05)
    return predicate()


def test_a_trickling_client_is_dropped_at_the_request_deadline():
    server = EngineServer(NeverFinishingEngine(), socket_timeout=5.0, request_deadline=0.5, max_connections=1).start()
    try:
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            dropped = False
            for byte in request:  # one byte every 0.1 s: every recv succeeds well within socket_timeout
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    dropped = True
                    break
                time.sleep(0.1)
            reply = b"" if dropped else sock.recv(4096)
        assert dropped or not reply.startswith(b"HTTP/1.1 200"), "a client trickling its headers was served"
        # its slot is free again: a well-behaved client gets through
        assert wait_for(lambda: server._httpd.open_connections == 0, 10)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        server.shutdown()


def test_a_generation_whose_client_hung_up_is_withdrawn():
    engine = NeverFinishingEngine()
    server = EngineServer(engine, request_timeout=120.0).start()
    try:
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert engine.submitted.wait(10)
        # the client is gone; without the watch the request would run until request_timeout (120 s)
        assert wait_for(lambda: len(engine.aborted) == 1, 20), "the abandoned generation was not withdrawn"
    finally:
        server.shutdown()


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_a_400(depth):
    server = EngineServer(NeverFinishingEngine(), max_body_bytes=1 << 20).start()
    try:
        body = b'{"input_ids": ' + b"[" * depth + b"]" * depth + b"}"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
        assert b"nested" in reply
    finally:
        server.shutdown()


@pytest.mark.parametrize("length_header,status", [
    (b"Transfer-Encoding: chunked", b"411"),  # no Content-Length at all
    (b"Content-Length: \xb2", b"411"),  # latin-1 superscript two: str.isdigit() says yes, int() refuses it
    (b"Content-Length: " + b"1" * 5000, b"413"),  # past int()'s digit limit for str
], ids=["chunked", "superscript-digit", "5000-digits"])
def test_a_body_without_a_usable_content_length_is_refused_and_the_connection_closes(length_header, status):
    """The server cannot tell where such a body ends, so it must not read the rest as the next request."""
    engine = NeverFinishingEngine()
    server = EngineServer(engine).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + length_header + b"\r\n\r\n"
                         b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the "body", shaped like a second request
            reply = b""
            while chunk := sock.recv(65536):  # ends when the server closes the connection
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]
        assert reply.count(b"HTTP/1.1 ") == 1, "the unread body was served as a request"
        assert not engine.submitted.is_set()
    finally:
        server.shutdown()
