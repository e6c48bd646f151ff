"""What the package's two HTTP servers share (the rollout engine's :class:`~.server.EngineServer` and the OpenAI
proxy, :class:`~glm5_core.rl.rollout.proxy.OpenAIProxy`): a :class:`~.connections.BoundedThreadingHTTPServer`
bound when the object is built (port 0: any free one; ``LOCALHOST`` unless the caller names another host), its
port and URL, serving from a daemon thread and stopping. Each subclass brings its routes (``handler_class``) and
its error bodies."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler
from typing import Optional, Type

from glm5_core.rl.serving.connections import BoundedThreadingHTTPServer

LOCALHOST = "127.0.0.1"


class HTTPService:
    def __init__(self, handler_class: Type[BaseHTTPRequestHandler], *, host: str = LOCALHOST, port: int = 0,
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
