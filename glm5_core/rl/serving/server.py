"""HTTP front end of a rollout engine: the routes and response shapes of SGLang's HTTP server
(``sglang/srt/entrypoints/http_server.py``), plus one glm5 route.

Routes as SGLang answers them: ``POST /generate`` (see ``protocol``); ``GET /health`` (empty 200, 503 once the
engine failed); ``GET /get_server_info`` (server arguments, ``internal_states``, ``version``; glm5 engine
counters as extras at the top level; 0.5.23's name ``/server_info`` too); ``GET /get_model_info`` (and
``/model_info``), ``GET /get_weight_version``; ``POST /abort_request`` ``{"rid", "abort_all"}`` (the request ends
with ``finish_reason`` abort and what it sampled);
``GET|POST /flush_cache`` (plain-text body); ``POST /update_weights_from_disk`` ``{"model_path", "weight_version",
"flush_cache"}`` (see ``weight_updates``), answered ``{"success", "message", "num_paused_requests"}`` (400 with
``success`` false when it fails); ``POST /init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group`` (``{"success", "message"}``); ``POST /pause_generation`` ``{"mode"}`` and
``/continue_generation``. glm5's own: ``POST /end_trajectories`` ``{"rids": [...]}`` (finished trajectories:
free their prefix-cache entries, like closing SGLang sessions).

With ``api_key`` every route but ``/health*`` needs ``Authorization: Bearer KEY`` (401 ``{"error":
"Unauthorized"}`` otherwise), SGLang's ``--api-key`` middleware. The server binds 127.0.0.1 unless given a host.
Bodies are capped (``max_body_bytes``) and nested at most ``MAX_JSON_DEPTH`` levels; requests are validated
before they reach the engine; a bad request is a 400 with the ``ValueError`` message, never a crash.

Fault handling:

* ``GET /health`` is 503 with the failure text once the engine's scheduler has failed
  (``RolloutEngine.healthy()``), so a supervisor replaces the worker; ``/generate`` on such an engine is a 503
  too (the request never ran: safe to send elsewhere). A request that failed *inside* the engine is a 500.
* A connection may wait ``socket_timeout`` for its next request, and must then send the whole of it within
  ``request_deadline`` seconds (see ``connections.DeadlineReader``): a client that stalls, or trickles bytes,
  is dropped, not served by a thread forever. A body the route does not read (a 401, a 404, a GET with a body)
  is discarded before the reply, or the connection closes (``http_service.RequestHandler``).
* At most ``max_connections`` connections are served at once (one thread each); past that a new connection
  is answered ``503`` with ``Retry-After: 1`` at once and closed (clients treat it as "busy, retry later").
* While a ``/generate`` runs, the server watches its connection: a client that hung up has its request
  withdrawn from the engine (:meth:`RolloutEngine.abort`), so abandoned generations stop costing tokens.
  One that does not finish within ``request_timeout`` is a 504 and is withdrawn the same way.
"""
from __future__ import annotations

import concurrent.futures
import hmac
import os
import threading
from typing import Any, Callable, Optional

from glm5_core.rl.serving.connections import peer_closed
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.http_service import LOCALHOST, HTTPService, RequestHandler
from glm5_core.rl.serving.json_http import BodyError, ClientStalledError, parse_json_body
from glm5_core.rl.serving.protocol import parse_generate_batch
from glm5_core.rl.serving.replay_trace import TraceLayout
from glm5_core.rl.serving.weight_updates import DistributedReceiver, VersionLabels, load_disk_weights

DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_END_TRAJECTORIES = 4096  # ids per /end_trajectories request
DEFAULT_SOCKET_TIMEOUT = 30.0  # seconds a connection may stay silent (idle keep-alive, between reads)
DEFAULT_REQUEST_DEADLINE = 30.0  # seconds from a request's first byte to its last
DEFAULT_MAX_CONNECTIONS = 256  # connections (= handler threads) served at once
HANGUP_POLL_S = 0.05  # how often a running /generate checks that its client is still there
WEIGHTS_APPLY_TIMEOUT_S = 600.0
Reply = tuple[int, Any]  # (status, JSON-able body | str (plain text) | None (empty))


class EngineUnavailableError(Exception):
    """The engine cannot take requests (its scheduler failed or it is shutting down): HTTP 503."""


class RequestTimeoutError(Exception):
    """The engine did not finish the request within ``request_timeout``: HTTP 504."""


class ClientGoneError(Exception):
    """The client hung up while its request ran: nobody to answer."""


def _update_reply(success: bool, message: str, **extra) -> Reply:
    return (200 if success else 400), {"success": success, "message": message, **extra}


class EngineServer(HTTPService):
    """Serves ``engine`` on ``host``:``port`` (0 = any free port) from a background thread. ``weight_version``
    is the label of the engine's current version (default: its number; ``glm5 serve`` says ``"default"``)."""

    def __init__(self, engine: RolloutEngine, *, host: str = LOCALHOST, port: int = 0,
                 weights_dir: Optional[str] = None, api_key: Optional[str] = None,
                 weight_version: Optional[str] = None, model_path: Optional[str] = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_timeout: float = 600.0,
                 socket_timeout: float = DEFAULT_SOCKET_TIMEOUT, request_deadline: float = DEFAULT_REQUEST_DEADLINE,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if not socket_timeout > 0:
            raise ValueError(f"socket_timeout: expected seconds > 0, got {socket_timeout!r}")
        if not request_deadline > 0:
            raise ValueError(f"request_deadline: expected seconds > 0, got {request_deadline!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections: expected an int >= 1, got {max_connections!r}")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key: expected a non-empty str or None")
        self.engine = engine
        self.weights_dir = os.path.realpath(weights_dir) if weights_dir else None
        self.model_path = model_path
        self.api_key = api_key
        self.max_body_bytes = int(max_body_bytes)
        self.request_timeout = float(request_timeout)
        self.socket_timeout = float(socket_timeout)
        self.request_deadline = float(request_deadline)
        self.labels = VersionLabels(engine.version, weight_version)
        self.receiver = DistributedReceiver()
        self._update_lock = threading.Lock()  # one weight update at a time
        self._running: dict[str, list[concurrent.futures.Future]] = {}  # rid -> its requests in the engine
        self._running_lock = threading.Lock()
        super().__init__(self._handler_class(), host=host, port=port, max_connections=max_connections,
                         thread_name="engine-http")

    @property
    def layout(self) -> TraceLayout:
        """Where the model's replay traces sit in SGLang's per-layer arrays (the model's config may not change)."""
        return TraceLayout.of(self.engine.model.config)

    def start(self) -> EngineServer:
        self.engine.start()
        self.serve_in_background()
        return self

    def serve_forever(self) -> None:
        self.engine.start()
        self._httpd.serve_forever()

    def shutdown_from_main(self) -> None:
        """After :meth:`serve_forever` returned on this thread (``httpd.shutdown`` would wait for it forever)."""
        self.engine.shutdown()
        self._httpd.server_close()
        self.receiver.close()

    def shutdown(self) -> None:
        """Engine first: requests in flight end now (finish_reason abort) instead of holding the handlers."""
        self.engine.shutdown()
        self.stop_serving()
        self.receiver.close()

    # -- route handlers (return (status, body)) -------------------------------------------------------------
    def engine_failure(self) -> Optional[str]:
        """Why the engine cannot serve, or None while it is healthy."""
        if self.engine.healthy():
            return None
        failure = self.engine.failure
        if failure is None:
            return "engine scheduler thread is not running"
        return f"engine scheduler failed: {type(failure).__name__}: {failure}"

    def handle_health(self) -> Reply:
        failure = self.engine_failure()
        return (200, None) if failure is None else (503, {"error": failure})

    def handle_generate(self, body: Any, client_gone: Callable[[], bool] = lambda: False) -> Reply:
        """One request, or a batch (``input_ids`` a list of lists: a list of answers in order)."""
        requests, batch = parse_generate_batch(body, self.engine.limits)
        failure = self.engine_failure()
        if failure is not None:
            raise EngineUnavailableError(failure)
        futures: list[concurrent.futures.Future] = []
        try:
            for request in requests:
                futures.append(self.engine.submit(request))
                with self._running_lock:
                    self._running.setdefault(request.rid, []).append(futures[-1])
        except RuntimeError as exc:  # failed or shutting down meanwhile: the requests never ran
            for future in futures:
                self.engine.abort(future)
            self._forget(requests, futures)
            raise EngineUnavailableError(str(exc)) from None
        try:
            results = self._wait(requests, futures, client_gone)
        finally:
            self._forget(requests, futures)
        answers = [result.to_json(request.return_logprob, label=self.labels.label,
                                  current_version=self.engine.version, layout=self.layout,
                                  prompt_ids=request.input_ids if request.return_prompt_token_ids else None)
                   for request, result in zip(requests, results)]
        return 200, (answers if batch else answers[0])

    def _wait(self, requests, futures, client_gone: Callable[[], bool]) -> list:
        waited = 0.0
        for future in futures:
            while True:
                try:
                    future.result(timeout=HANGUP_POLL_S)
                    break
                except concurrent.futures.TimeoutError:
                    waited += HANGUP_POLL_S
                if client_gone():
                    for f in futures:
                        self.engine.abort(f)  # nobody will read the results: free the slots now
                    raise ClientGoneError(requests[0].rid)
                if waited >= self.request_timeout:
                    for f in futures:
                        self.engine.abort(f)  # a retry goes elsewhere
                    raise RequestTimeoutError(f"request {requests[0].rid}: not finished within "
                                              f"{self.request_timeout}s")
        return [future.result() for future in futures]

    def _forget(self, requests, futures) -> None:
        with self._running_lock:
            for request, future in zip(requests, futures):
                running = self._running.get(request.rid, [])
                if future in running:
                    running.remove(future)
                if not running:
                    self._running.pop(request.rid, None)

    def handle_abort_request(self, body: Any) -> Reply:
        """SGLang's ``/abort_request`` ``{"rid": str, "abort_all": bool}``: the named request (or every one) ends
        now with ``finish_reason`` abort, returning what it sampled. An unknown rid is not an error (SGLang's
        answer is an empty 200 either way)."""
        if not isinstance(body, dict):
            raise ValueError("request: expected a JSON object")
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise ValueError(f"rid / abort_all: expected a str and a bool, got {rid!r:.80} / {abort_all!r:.20}")
        with self._running_lock:
            futures = [f for r, fs in self._running.items() if abort_all or r == rid for f in fs]
        for future in futures:
            self.engine.abort(future)
        return 200, None

    def _apply(self, state_dict, label, *, partial: bool) -> int:
        version = self.labels.engine_version(label, self.engine.newest_version)
        self.engine.update_weights(state_dict, version, partial=partial, wait=WEIGHTS_APPLY_TIMEOUT_S)
        self.labels.remember(version, label)
        return version

    def handle_update_from_disk(self, body: Any) -> Reply:
        if not isinstance(body, dict):
            raise ValueError("request: expected a JSON object")
        unknown = sorted(set(body) - {"model_path", "weight_version", "load_format", "flush_cache",
                                      "abort_all_requests", "is_async", "torch_empty_cache", "keep_pause",
                                      "recapture_cuda_graph", "token_step"})
        if unknown:
            raise ValueError(f"request: unknown fields {unknown}")
        with self._update_lock:
            try:
                state_dict = load_disk_weights(body.get("model_path"), self.weights_dir)
                version = self._apply(state_dict, body.get("weight_version"), partial=False)
            except ValueError as exc:  # wrong keys / shapes, non-finite, older version, unreadable
                return _update_reply(False, str(exc), num_paused_requests=0)
        if body.get("model_path") and os.path.isdir(body["model_path"]):
            self.model_path = body["model_path"]
        return _update_reply(True, f"Succeeded to update model weights. Weight version updated to "
                                   f"{self.labels.label(version)}.", num_paused_requests=0)

    def handle_init_group(self, body: Any) -> Reply:
        if not isinstance(body, dict):
            raise ValueError("request: expected a JSON object")
        try:
            self.receiver.init_group(body)
        except ValueError as exc:
            return _update_reply(False, str(exc))
        return _update_reply(True, "Succeeded to initialize custom process group.")

    def handle_update_from_distributed(self, body: Any) -> Reply:
        if not isinstance(body, dict):
            raise ValueError("request: expected a JSON object")
        unknown = sorted(set(body) - {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                                      "weight_version", "load_format", "torch_empty_cache"})
        if unknown:
            raise ValueError(f"request: unknown fields {unknown}")
        with self._update_lock:
            try:
                tensors = self.receiver.receive(body, self.engine.model.state_dict())
                self._apply(tensors, body.get("weight_version"), partial=True)
            except ValueError as exc:
                return _update_reply(False, str(exc))
        return _update_reply(True, "Succeeded to update parameter online.")

    def handle_destroy_group(self, body: Any) -> Reply:
        name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise ValueError("group_name: expected a str")
        found = self.receiver.destroy(name)
        return _update_reply(found, "Succeeded to destroy custom process group." if found else f"no group {name!r}")

    def handle_pause(self, body: Any) -> Reply:
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        self.engine.pause(mode)  # ValueError for a mode this engine does not implement (retract)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def handle_continue(self, body: Any) -> Reply:
        self.engine.resume()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def handle_flush_cache(self, body: Any = None) -> Reply:
        self.engine.prefix_cache.flush()
        return 200, ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                     "waiting requests, the operation will not be performed.)\n")

    def handle_end_trajectories(self, body: Any) -> Reply:
        rids = body.get("rids") if isinstance(body, dict) else None
        if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rids: expected a list of trajectory ids (str), got {type(rids).__name__}")
        if len(rids) > MAX_END_TRAJECTORIES:
            raise ValueError(f"rids: expected at most {MAX_END_TRAJECTORIES} ids per request, got {len(rids)}")
        for rid in rids:
            self.engine.end_trajectory(rid)
        return 200, {"success": True, "ended": len(rids)}

    def weight_version(self) -> str:
        return self.labels.label(self.engine.version)

    def handle_model_info(self) -> Reply:
        """SGLang 0.5.23's ``/model_info`` fields (``http_server.model_info``) this engine has."""
        return 200, {"model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": None,
                     "is_generation": True, "preferred_sampling_params": None,
                     "weight_version": self.weight_version(), "load_format": "auto", "reasoning_parser": None,
                     "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                     "has_audio_understanding": False, "model_type": "glm_moe_dsa",
                     "architectures": ["GlmMoeDsaForCausalLM"]}

    def handle_info(self) -> Reply:
        """SGLang's shape (server arguments, scheduler info, ``internal_states``, ``version``), then the glm5
        engine counters, which SGLang does not have (readers treat them as optional)."""
        import glm5_core

        counters = self.engine.stats.as_dict()
        info: dict[str, Any] = {
            "model_path": self.model_path, "host": self.host, "port": self.port, "dp_size": 1, "tp_size": 1,
            "skip_tokenizer_init": True, "weight_version": self.weight_version(),
            "max_req_input_len": self.engine.limits.max_input_tokens, "max_running_requests": self.engine.max_batch,
            "context_length": self.engine.max_len,
            "internal_states": [{"paused": self.engine.paused, "num_running_reqs": self.engine.num_active()}],
            "version": glm5_core.__version__,
        }
        if self.engine.speculative is not None:  # SGLang's field: tokens per row and verify step, since start
            info["internal_states"][0]["avg_spec_accept_length"] = \
                self.engine.speculative.stats.mean_acceptance_length()
        info.update(counters)
        info.update(max_batch=self.engine.max_batch, max_len=self.engine.max_len, active=self.engine.num_active(),
                    pid=os.getpid(), prefix_cache_entries=len(self.engine.prefix_cache),
                    prefix_cache_tokens=self.engine.prefix_cache.num_tokens,
                    open_connections=self._httpd.open_connections,
                    rejected_connections=self._httpd.rejected_connections)
        return 200, info

    def authorized(self, path: str, header: Optional[str]) -> bool:
        if self.api_key is None or path.startswith("/health"):
            return True
        return header is not None and hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode())

    def _handler_class(self):
        server = self
        get_routes = {
            "/health": server.handle_health, "/health_generate": server.handle_health,
            "/get_server_info": server.handle_info, "/get_model_info": server.handle_model_info,
            "/server_info": server.handle_info, "/model_info": server.handle_model_info,  # 0.5.23's names
            "/get_weight_version": lambda: (200, {"weight_version": server.weight_version()}),
            "/flush_cache": server.handle_flush_cache,
        }
        post_routes = {
            "/generate": server.handle_generate,
            "/update_weights_from_disk": server.handle_update_from_disk,
            "/init_weights_update_group": server.handle_init_group,
            "/update_weights_from_distributed": server.handle_update_from_distributed,
            "/destroy_weights_update_group": server.handle_destroy_group,
            "/pause_generation": server.handle_pause,
            "/continue_generation": server.handle_continue,
            "/flush_cache": server.handle_flush_cache,
            "/end_trajectories": server.handle_end_trajectories,
            "/abort_request": server.handle_abort_request,
        }

        class Handler(RequestHandler):
            socket_timeout = server.socket_timeout
            request_deadline = server.request_deadline
            max_body_bytes = server.max_body_bytes

            def _reply(self, status: int, payload: Any) -> None:
                self.reply(status, payload)

            def _body(self) -> Any:
                raw = self.body()
                return parse_json_body(raw) if raw else {}

            def _route(self, routes: dict, call: Callable) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    if not server.authorized(path, self.headers.get("Authorization")):
                        self._reply(401, {"error": "Unauthorized"})
                    elif path not in routes:
                        self._reply(404, {"error": f"unknown route {path}"})
                    else:
                        self._reply(*call(routes[path]))
                except (ClientStalledError, ClientGoneError):  # nobody to answer: drop the connection
                    self.close_connection = True
                except BodyError as exc:  # 411 / 413 (the body unread: the connection closes), bad JSON
                    if exc.close:
                        self.close_connection = True
                    self._reply(exc.status, {"error": str(exc)})
                except ValueError as exc:
                    self._reply(400, {"error": str(exc)})
                except EngineUnavailableError as exc:
                    self._reply(503, {"error": str(exc)})
                except RequestTimeoutError as exc:
                    self._reply(504, {"error": str(exc)})
                except Exception as exc:  # the request failed inside the engine: report, keep serving
                    self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

            def do_GET(self):
                self._route(get_routes, lambda handler: handler())

            def do_POST(self):
                def call(handler):
                    body = self._body()
                    if handler == server.handle_generate:  # bound methods: equal, never identical
                        return handler(body, lambda: peer_closed(self.connection))
                    return handler(body)

                self._route(post_routes, call)

        return Handler
