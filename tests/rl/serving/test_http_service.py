"""Issue 35 item 7: the HTTP skeleton both servers share (``serving/http_service.py``): a request body the route
does not read (a 401, a 404, a GET that carries one) is consumed before the reply, never parsed as the next request
on the keep-alive connection (HTTP desync / request smuggling); a body too large to discard closes the connection;
and the OpenAI proxy drops a client that trickles its request at the request deadline, as the engine server does.

Driven over raw sockets: the requests are written back to back on one connection and the replies read in order."""
import json
import socket
import time

import pytest

from glm5_core.rl.rollout.chat_tokenizer_builder import build_tokenizer_dir
from glm5_core.rl.rollout.proxy import OpenAIProxy
from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer
from glm5_core.rl.serving.server import EngineServer
from tests.rl.serving.test_server_hostile_clients import NeverFinishingEngine, wait_for

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"  # a body that reads as a request if left unread


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_chat_tokenizer(build_tokenizer_dir(str(tmp_path_factory.mktemp("tok"))))


def req(method, path, body=b"", headers=()):
    head = [f"{method} {path} HTTP/1.1", "Host: x", *headers]
    if body:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_reply(stream):
    """(status, headers (lower-case names), body) of the next reply on ``stream``; None at the end."""
    line = stream.readline()
    if not line:
        return None
    status = int(line.split()[1])
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, stream.read(int(headers.get("content-length", 0)))


def exchange(port, *requests):
    """Write ``requests`` back to back on one connection; the replies until the server closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"".join(requests))
        stream = sock.makefile("rb")
        replies = []
        try:
            sock.settimeout(0.5)
            while (reply := read_reply(stream)) is not None:
                replies.append(reply)
        except (TimeoutError, OSError):
            pass
        return replies


@pytest.fixture
def engine_server():
    server = EngineServer(NeverFinishingEngine(), api_key="k", max_body_bytes=1024).start()
    yield server
    server.shutdown()


@pytest.fixture
def proxy(tok):
    server = OpenAIProxy(tok, lambda tid, r: None, max_context_tokens=64, max_body_bytes=1024).start()
    yield server
    server.shutdown()


AUTH = ("Authorization: Bearer k",)


@pytest.mark.parametrize("first", [
    req("POST", "/generate", SMUGGLED),  # 401: no key
    req("POST", "/nope", SMUGGLED, AUTH),  # 404
    req("GET", "/get_weight_version", SMUGGLED, AUTH),  # a GET with a body
], ids=["401", "404", "get-with-body"])
def test_engine_server_answers_the_next_request_as_itself(engine_server, first):
    replies = exchange(engine_server.port, first, req("GET", "/get_weight_version", headers=AUTH))
    assert [status for status, _, _ in replies][1:] == [200], replies
    assert "weight_version" in json.loads(replies[1][2])


@pytest.mark.parametrize("first", [
    req("POST", "/v1/nope", SMUGGLED),  # 404
    req("GET", "/health", SMUGGLED),  # a GET with a body
    req("GET", "/v1/nope", SMUGGLED),
], ids=["post-404", "get-with-body", "get-404"])
def test_proxy_answers_the_next_request_as_itself(proxy, first):
    replies = exchange(proxy.port, first, req("GET", "/v1/models"))
    assert len(replies) == 2, replies
    assert replies[1][0] == 200 and json.loads(replies[1][2])["object"] == "list", replies


@pytest.mark.parametrize("which", ["engine_server", "proxy"])
def test_an_unread_body_past_the_cap_closes_the_connection(which, request):
    server = request.getfixturevalue(which)
    head = (b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + SMUGGLED)
    replies = exchange(server.port, head, req("GET", "/health"))
    assert len(replies) == 1 and replies[0][0] in (401, 404), replies
    assert replies[0][1].get("connection") == "close"


def test_the_proxy_drops_a_trickling_client_at_the_request_deadline(tok):
    proxy = OpenAIProxy(tok, lambda tid, r: None, max_context_tokens=64, socket_timeout=5.0, request_deadline=0.5,
                        max_connections=1).start()
    try:
        slow = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            dropped = False
            for byte in slow:  # one byte every 0.1 s: every recv is well within socket_timeout
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.1)
                except OSError:
                    dropped = True
                    break
            reply = b"" if dropped else sock.recv(4096)
        assert dropped or not reply.startswith(b"HTTP/1.1 200"), "a client trickling its headers was served"
        assert time.monotonic() - start < 5.0 or dropped
        assert wait_for(lambda: proxy._httpd.open_connections == 0, 10)  # its slot is free again
        assert exchange(proxy.port, req("GET", "/health", headers=("Connection: close",)))[0][0] == 200
    finally:
        proxy.shutdown()


def test_request_deadline_is_checked(tok):
    with pytest.raises(ValueError, match="request_deadline"):
        OpenAIProxy(tok, lambda tid, r: None, max_context_tokens=64, request_deadline=0)
