"""JSON over HTTP, shared by the rollout engine's server (``serving/server.py``) and the OpenAI proxy
(``rollout/proxy.py``): reading a request body under a size cap, parsing it with bounded nesting, writing a reply.

Each server turns the errors into its own error body (SGLang's ``{"error": ...}``, OpenAI's ``{"error": {...}}``):

* :class:`BodyError` (a ``ValueError``) carries the HTTP status: 411 without a ``Content-Length``, 413 past the
  cap (both ``close``: the body was not read, so the connection cannot be reused), 400 for invalid or too deeply
  nested JSON;
* :class:`ClientStalledError`: the body did not arrive in time or whole; there is nobody to answer, the
  connection is dropped.
"""
from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

MAX_JSON_DEPTH = 32  # no route of the engine server takes more than a few levels
MAX_LENGTH_DIGITS = 18  # a Content-Length of more digits is past any cap (caps are far below 10**18)


class BodyError(ValueError):
    """A request body the server refuses, answered with ``status``; ``close`` when the connection must close."""

    def __init__(self, message: str, status: int = 400, *, close: bool = False):
        super().__init__(message)
        self.status = status
        self.close = close


class ClientStalledError(Exception):
    """The client stopped sending its request in time: the connection is dropped."""


def read_body(handler: BaseHTTPRequestHandler, max_bytes: int) -> bytes:
    """The ``Content-Length`` bytes of the request ``handler`` serves, at most ``max_bytes``."""
    length = handler.headers.get("Content-Length")
    # ASCII digits only: str.isdigit() also takes e.g. latin-1 '\xb2', which int() refuses
    if length is None or not (length.isascii() and length.isdigit()):
        raise BodyError("Content-Length: expected a byte count", 411, close=True)
    if len(length) > MAX_LENGTH_DIGITS or int(length) > max_bytes:  # the length first: int() caps its digits
        raise BodyError(f"request body: expected at most {max_bytes} bytes, got {length[:40]}", 413, close=True)
    try:
        raw = handler.rfile.read(int(length))
    except TimeoutError:
        raise ClientStalledError("request body not received in time") from None
    if len(raw) != int(length):
        raise ClientStalledError(f"request body: the client closed after {len(raw)} of {length} bytes")
    return raw


def _check_depth(value: Any, limit: int) -> None:
    stack = [(value, 1)]  # iterative: a deep value cannot exhaust the recursion limit here
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                raise BodyError(f"request body: JSON nested deeper than {limit} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of ``raw``; :class:`BodyError` (400) for invalid or too deeply nested JSON."""
    try:
        value = json.loads(raw)
    except RecursionError:  # nested past Python's recursion limit
        raise BodyError(f"request body: JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int literals past Python's digit limit
        raise BodyError(f"request body: invalid JSON ({getattr(exc, 'msg', exc)})") from None
    _check_depth(value, max_depth)
    return value


def write_reply(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    """Answer ``status`` with ``payload``: None an empty body, a str plain text, anything else JSON; with
    ``Connection: close`` when the handler will close the connection after it."""
    if payload is None:
        data, kind = b"", None
    elif isinstance(payload, str):
        data, kind = payload.encode("utf-8"), "text/plain; charset=utf-8"
    else:
        data, kind = json.dumps(payload).encode("utf-8"), "application/json"
    handler.send_response(status)
    if kind is not None:
        handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(data)))
    if getattr(handler, "close_connection", False):
        handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(data)
