"""What the package's two HTTP servers share (the rollout engine's :class:`~.server.EngineServer` and the OpenAI
proxy, :class:`~glm5_core.rl.rollout.proxy.OpenAIProxy`): a :class:`~.connections.BoundedThreadingHTTPServer`
bound when the object is built (port 0: any free one; ``LOCALHOST`` unless the caller names another host), its
port and URL, serving from a daemon thread and stopping. Each subclass brings its routes (a
:class:`RequestHandler` subclass) and its error bodies.

:class:`RequestHandler` is the connection skeleton both use:

* each request (line, headers and body) must arrive within ``request_deadline`` seconds of its first byte, and a
  keep-alive connection may wait ``socket_timeout`` for the next one (:class:`~.connections.DeadlineReader`): a
  client that stalls or trickles bytes is dropped, so slow clients cannot hold every slot;
* a request's body is always consumed before its reply is written: read by the route (:meth:`RequestHandler.body`)
  or, when the route answers without it (a 401, a 404, a GET that carried a body), discarded up to
  ``max_body_bytes``; a body that cannot be discarded (larger, chunked, an unusable ``Content-Length``) closes the
  connection (``Connection: close``). An unread body is never parsed as the next request on the connection.
"""
from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Optional

from glm5_core.rl.serving.connections import BoundedThreadingHTTPServer, DeadlineReader
from glm5_core.rl.serving.json_http import MAX_LENGTH_DIGITS, read_body, write_reply

LOCALHOST = "127.0.0.1"
DISCARD_CHUNK = 1 << 16


class RequestHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive handler under the deadlines above; subclasses set the three limits and the routes,
    read bodies with :meth:`body` and answer with :meth:`reply`."""

    protocol_version = "HTTP/1.1"
    socket_timeout: float = 30.0
    request_deadline: float = 30.0
    max_body_bytes: int = 4 << 20

    def setup(self):
        super().setup()
        self.connection.settimeout(self.socket_timeout)
        self.reader = DeadlineReader(self.connection, idle_timeout=self.socket_timeout,
                                     request_deadline=self.request_deadline)
        self.rfile = io.BufferedReader(self.reader)
        self._body_pending = False

    def handle_one_request(self):
        self.reader.begin_request()
        self._body_pending = True
        super().handle_one_request()
        if self._body_pending:  # no reply went through reply() (a parse error, a dropped client): do not guess
            self.close_connection = True

    def log_message(self, fmt, *args):  # quiet
        return

    def body(self) -> bytes:
        """The request's body (``json_http.read_body`` under ``max_body_bytes``); the request deadline ends."""
        raw = read_body(self, self.max_body_bytes)
        self._body_pending = False
        self.reader.end_request()
        return raw

    def discard_body(self) -> None:
        """Consume a body the route did not read, so the next request starts where it should; close the
        connection when that cannot be done safely."""
        if not self._body_pending:
            return
        self._body_pending = False
        if self.close_connection:
            return
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") is not None:
            self.close_connection = True  # chunked bodies are not read by these servers
        elif length is None:
            pass  # a request without Content-Length or Transfer-Encoding has no body (RFC 9112 6.3)
        elif not (length.isascii() and length.isdigit()) or len(length) > MAX_LENGTH_DIGITS \
                or int(length) > self.max_body_bytes:
            self.close_connection = True
        else:
            left = int(length)
            try:
                while left:
                    chunk = self.rfile.read(min(left, DISCARD_CHUNK))
                    if not chunk:
                        break
                    left -= len(chunk)
            except (TimeoutError, OSError):
                left = -1
            if left:
                self.close_connection = True
        self.reader.end_request()

    def reply(self, status: int, payload: Any) -> None:
        """Answer ``status`` with ``payload`` (``json_http.write_reply``), the request's body consumed first."""
        self.discard_body()
        write_reply(self, status, payload)


class HTTPService:
    def __init__(self, handler_class: type[BaseHTTPRequestHandler], *, host: str = LOCALHOST, port: int = 0,
                 max_connections: int, thread_name: str):
        self.host = host
        self._thread_name = thread_name
        self._httpd = BoundedThreadingHTTPServer((host, port), handler_class, max_connections=max_connections)
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return self._httpd.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve_in_background(self) -> None:
        """Serve from a daemon thread (named after the service) and return at once."""
        self._thread = self._httpd.serve_in_background(self._thread_name)

    def stop_serving(self) -> None:
        """Stop the accept loop and close the socket (handler threads are not waited for)."""
        self._httpd.stop()
