"""HTTP front end of a rollout engine, SGLang-compatible where SGLang defines the route.

Routes: ``POST /generate`` (see ``protocol``), ``POST /update_weights_from_disk`` ``{"model_path",
"weight_version"}`` (a safetensors file inside the directory the server was started with),
``POST /flush_cache``, ``POST /end_trajectories`` ``{"rids": [...]}`` (finished trajectories: free their
prefix-cache entries, like closing SGLang sessions), ``GET /health``, ``GET /get_server_info`` (engine counters
and weight version).

The server binds to 127.0.0.1 only. Bodies are capped (``max_body_bytes``) and requests validated before
they reach the engine; a bad request is a 400 with the ``ValueError`` message, never a crash.

Fault handling:

* ``GET /health`` is 503 with the failure text once the engine's scheduler has failed
  (``RolloutEngine.healthy()``), so a supervisor replaces the worker; ``/generate`` on such an engine is a 503
  too (the request never ran: safe to send elsewhere). A request that failed *inside* the engine is a 500.
* Every connection has a socket timeout (``socket_timeout``): a client that sends headers and then stalls,
  or keeps an idle connection open, is dropped after it, not served by a thread forever.
* At most ``max_connections`` connections are served at once (one thread each); past that a new connection
  is answered ``503`` with ``Retry-After: 1`` at once and closed (clients treat it as "busy, retry later").
  The accept loop never reads the request, so a client that was still sending it may see a connection reset
  instead; :class:`~glm5_core.rl.fleet.replicas.ReplicaSet` retries both, and ``/health`` counts busy as alive.
* A ``/generate`` that does not finish within ``request_timeout`` is a 504, and the request is withdrawn from
  the engine (:meth:`RolloutEngine.abort`): dropped if still waiting, stopped at the next step if running.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional, Tuple

from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import parse_generate_request

LOCALHOST = "127.0.0.1"
DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_END_TRAJECTORIES = 4096  # ids per /end_trajectories request
DEFAULT_SOCKET_TIMEOUT = 30.0  # seconds a connection may stay silent (headers, body, idle keep-alive)
DEFAULT_MAX_CONNECTIONS = 256  # connections (= handler threads) served at once


class EngineUnavailableError(Exception):
    """The engine cannot take requests (its scheduler failed or it is shutting down): HTTP 503."""


class RequestTimeoutError(Exception):
    """The engine did not finish the request within ``request_timeout``: HTTP 504."""


class ClientStalledError(Exception):
    """The client stopped sending its request within the socket timeout: the connection is dropped."""


def load_weights_file(path: str) -> Dict[str, Any]:
    """Tensors of a safetensors file (never pickle)."""
    from safetensors.torch import load_file

    return load_file(path)


def _busy_response(max_connections: int) -> bytes:
    body = json.dumps({"error": f"server busy: {max_connections} connections already being served"}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once; a connection past the cap gets a
    ``503 Retry-After: 1`` from the accept loop itself (never blocking it) and is closed."""

    daemon_threads = True
    block_on_close = False  # shutdown must not wait for idle keep-alive connections (up to socket_timeout)
    request_queue_size = 1024

    def __init__(self, address, handler_class, *, max_connections: int):
        self.max_connections = max_connections
        self.open_connections = 0  # served now (under _slots_lock)
        self.rejected_connections = 0  # written by the accept loop only
        self._slots_lock = threading.Lock()
        self._busy = _busy_response(max_connections)
        super().__init__(address, handler_class)

    def _take_slot(self) -> bool:
        with self._slots_lock:
            if self.open_connections >= self.max_connections:
                return False
            self.open_connections += 1
            return True

    def _free_slot(self) -> None:
        with self._slots_lock:
            self.open_connections -= 1

    def process_request(self, request, client_address):
        if not self._take_slot():
            self.rejected_connections += 1
            self._reject(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the handler thread
        except BaseException:
            self._free_slot()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._free_slot()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):  # the client went away or stalled mid-reply: nothing to report
            return
        super().handle_error(request, client_address)

    def _reject(self, request: socket.socket) -> None:
        try:
            request.setblocking(False)  # a fresh socket's send buffer is empty: this never waits
            request.send(self._busy)
            request.recv(1 << 16)  # drop what already arrived, so closing sends FIN rather than RST
        except OSError:
            pass


class EngineServer:
    """Serves ``engine`` on 127.0.0.1:``port`` (0 = any free port) from a background thread."""

    def __init__(self, engine: RolloutEngine, *, port: int = 0, weights_dir: Optional[str] = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout: float = 600.0,
                 socket_timeout: float = DEFAULT_SOCKET_TIMEOUT, max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if not socket_timeout > 0:
            raise ValueError(f"socket_timeout: expected seconds > 0, got {socket_timeout!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections: expected an int >= 1, got {max_connections!r}")
        self.engine = engine
        self.weights_dir = os.path.realpath(weights_dir) if weights_dir else None
        self.max_body_bytes = int(max_body_bytes)
        self.request_timeout = float(request_timeout)
        self.socket_timeout = float(socket_timeout)
        self._httpd = BoundedThreadingHTTPServer((LOCALHOST, port), self._handler_class(),
                                                 max_connections=max_connections)
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    def start(self) -> "EngineServer":
        self.engine.start()
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="engine-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.engine.start()
        self._httpd.serve_forever()

    def shutdown(self) -> None:
        """Engine first: requests in flight end now (finish_reason abort) instead of holding the handlers."""
        self.engine.shutdown()
        self._httpd.shutdown()
        self._httpd.server_close()  # does not wait for handler threads (block_on_close is off)

    # -- route handlers (return (status, json body)) --------------------------------------------------------
    def engine_failure(self) -> Optional[str]:
        """Why the engine cannot serve, or None while it is healthy."""
        if self.engine.healthy():
            return None
        failure = self.engine.failure
        if failure is None:
            return "engine scheduler thread is not running"
        return f"engine scheduler failed: {type(failure).__name__}: {failure}"

    def handle_health(self) -> Tuple[int, Dict]:
        failure = self.engine_failure()
        return (200, {"ok": True}) if failure is None else (503, {"ok": False, "error": failure})

    def handle_generate(self, body: Any) -> Tuple[int, Dict]:
        request = parse_generate_request(body, self.engine.limits)
        failure = self.engine_failure()
        if failure is not None:
            raise EngineUnavailableError(failure)
        try:
            future = self.engine.submit(request)
        except RuntimeError as exc:  # failed or shutting down meanwhile: the request never ran
            raise EngineUnavailableError(str(exc)) from None
        try:
            result = future.result(timeout=self.request_timeout)
        except concurrent.futures.TimeoutError:
            self.engine.abort(future)  # nobody will read the result: free the slot (a retry goes elsewhere)
            raise RequestTimeoutError(f"request {request.rid}: not finished within {self.request_timeout}s") from None
        return 200, result.to_json(request.return_logprob)

    def handle_update_weights(self, body: Any) -> Tuple[int, Dict]:
        if not isinstance(body, dict):
            raise ValueError("request: expected a JSON object")
        if self.weights_dir is None:
            raise ValueError("model_path: this server was started without a weights directory")
        path = body.get("model_path")
        version = body.get("weight_version")
        if not isinstance(path, str):
            raise ValueError(f"model_path: expected a str, got {path!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weight_version: expected an int >= 0, got {version!r}")
        real = os.path.realpath(path)
        if os.path.dirname(real) != self.weights_dir or not real.endswith(".safetensors"):
            raise ValueError(f"model_path: expected a .safetensors file directly inside {self.weights_dir}, "
                             f"got {path!r}")
        if not os.path.isfile(real):
            raise ValueError(f"model_path: no such file {path!r}")
        try:
            state_dict = load_weights_file(real)
        except Exception as exc:  # truncated / not safetensors: the caller's file is bad, the engine is fine
            raise ValueError(f"model_path: cannot read {path!r} as safetensors ({type(exc).__name__}: {exc})") from None
        self.engine.update_weights(state_dict, version)  # ValueError: wrong keys/shapes, non-finite, older version
        return 200, {"success": True, "weight_version": version}

    def handle_end_trajectories(self, body: Any) -> Tuple[int, Dict]:
        rids = body.get("rids") if isinstance(body, dict) else None
        if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rids: expected a list of trajectory ids (str), got {type(rids).__name__}")
        if len(rids) > MAX_END_TRAJECTORIES:
            raise ValueError(f"rids: expected at most {MAX_END_TRAJECTORIES} ids per request, got {len(rids)}")
        for rid in rids:
            self.engine.end_trajectory(rid)
        return 200, {"success": True, "ended": len(rids)}

    def handle_info(self) -> Tuple[int, Dict]:
        info = self.engine.stats.as_dict()
        info.update(weight_version=self.engine.version, max_batch=self.engine.max_batch,
                    max_len=self.engine.max_len, active=self.engine.num_active(), pid=os.getpid(),
                    prefix_cache_entries=len(self.engine.prefix_cache),
                    prefix_cache_tokens=self.engine.prefix_cache.num_tokens,
                    open_connections=self._httpd.open_connections,
                    rejected_connections=self._httpd.rejected_connections)
        return 200, info

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = server.socket_timeout  # applied to the connection in setup(): no thread waits forever

            def log_message(self, fmt, *args):  # quiet
                return

            def _reply(self, status: int, payload: Dict) -> None:
                data = json.dumps(payload).encode("utf-8")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                length = self.headers.get("Content-Length")
                if length is None or not length.isdigit():
                    raise ValueError("Content-Length: expected a byte count")
                if int(length) > server.max_body_bytes:
                    raise OverflowError(f"request body: expected at most {server.max_body_bytes} bytes, got {length}")
                try:
                    raw = self.rfile.read(int(length))
                except TimeoutError:
                    raise ClientStalledError(f"request body not received within {server.socket_timeout}s") from None
                if len(raw) != int(length):
                    raise ClientStalledError(f"request body: the client closed after {len(raw)} of {length} bytes")
                try:
                    return json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ValueError(f"request body: invalid JSON "
                                     f"({exc.msg if hasattr(exc, 'msg') else exc})") from None

            def do_GET(self):
                if self.path == "/health":
                    self._reply(*server.handle_health())
                elif self.path == "/get_server_info":
                    self._reply(*server.handle_info())
                else:
                    self._reply(404, {"error": f"unknown route {self.path}"})

            def do_POST(self):
                routes = {
                    "/generate": server.handle_generate,
                    "/update_weights_from_disk": server.handle_update_weights,
                    "/flush_cache": lambda body: (server.engine.prefix_cache.flush() or 200, {"success": True}),
                    "/end_trajectories": server.handle_end_trajectories,
                }
                try:
                    if self.path not in routes:
                        self._reply(404, {"error": f"unknown route {self.path}"})
                        return
                    self._reply(*routes[self.path](self._body()))
                except ClientStalledError:  # nobody to answer: drop the connection
                    self.close_connection = True
                except OverflowError as exc:
                    self.close_connection = True
                    self._reply(413, {"error": str(exc)})
                except ValueError as exc:
                    self._reply(400, {"error": str(exc)})
                except EngineUnavailableError as exc:
                    self._reply(503, {"error": str(exc)})
                except RequestTimeoutError as exc:
                    self._reply(504, {"error": str(exc)})
                except Exception as exc:  # the request failed inside the engine: report, keep serving
                    self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

        return Handler
