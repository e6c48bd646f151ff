"""HTTP front end of a rollout engine, SGLang-compatible where SGLang defines the route.

Routes: ``POST /generate`` (see ``protocol``), ``POST /update_weights_from_disk`` ``{"model_path",
"weight_version"}`` (a safetensors file inside the directory the server was started with),
``POST /flush_cache``, ``POST /end_trajectories`` ``{"rids": [...]}`` (finished trajectories: free their
prefix-cache entries, like closing SGLang sessions), ``GET /health``, ``GET /get_server_info`` (engine counters
and weight version).

The server binds to 127.0.0.1 only. Bodies are capped (``max_body_bytes``) and requests validated before
they reach the engine; a bad request is a 400 with the ``ValueError`` message, never a crash.
"""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional, Tuple

from glm5_core.rl.engine import RolloutEngine
from glm5_core.rl.protocol import parse_generate_request

LOCALHOST = "127.0.0.1"
DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_END_TRAJECTORIES = 4096  # ids per /end_trajectories request


def load_weights_file(path: str) -> Dict[str, Any]:
    """Tensors of a safetensors file (never pickle)."""
    from safetensors.torch import load_file

    return load_file(path)


class EngineServer:
    """Serves ``engine`` on 127.0.0.1:``port`` (0 = any free port) from a background thread."""

    def __init__(self, engine: RolloutEngine, *, port: int = 0, weights_dir: Optional[str] = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout: float = 600.0):
        self.engine = engine
        self.weights_dir = os.path.realpath(weights_dir) if weights_dir else None
        self.max_body_bytes = int(max_body_bytes)
        self.request_timeout = float(request_timeout)
        server_class = type("EngineHTTPServer", (ThreadingHTTPServer,), {"request_queue_size": 1024})
        self._httpd = server_class((LOCALHOST, port), self._handler_class())
        self._httpd.daemon_threads = True
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
        self._httpd.shutdown()
        self._httpd.server_close()
        self.engine.shutdown()

    # -- route handlers (return (status, json body)) --------------------------------------------------------
    def handle_generate(self, body: Any) -> Tuple[int, Dict]:
        request = parse_generate_request(body, self.engine.limits)
        result = self.engine.submit(request).result(timeout=self.request_timeout)
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
            raise ValueError(f"model_path: expected a .safetensors file directly inside {self.weights_dir}, got {path!r}")
        if not os.path.isfile(real):
            raise ValueError(f"model_path: no such file {path!r}")
        self.engine.update_weights(load_weights_file(real), version)
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
                    max_len=self.engine.max_len, active=self.engine.num_active(), pid=os.getpid())
        return 200, info

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

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
                raw = self.rfile.read(int(length))
                try:
                    return json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ValueError(f"request body: invalid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None

            def do_GET(self):
                if self.path == "/health":
                    self._reply(200, {"ok": True})
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
                except OverflowError as exc:
                    self.close_connection = True
                    self._reply(413, {"error": str(exc)})
                except ValueError as exc:
                    self._reply(400, {"error": str(exc)})
                except Exception as exc:  # engine failure: report, keep serving
                    self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

        return Handler
