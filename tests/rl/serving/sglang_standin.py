"""A stand-in SGLang server for tests: SGLang's HTTP routes, status codes and bodies, generating with a
glm5-core :class:`RolloutEngine`.

Built from SGLang's own source (sgl-project/sglang; read at the commits the search index holds):
``python/sglang/srt/entrypoints/http_server.py`` (commit 0025436e): the routes, ``/health`` answering an empty
200 (503 empty while unhealthy), ``/flush_cache`` a plain-text body, ``/update_weights_from_disk`` ``{"success",
"message", "num_paused_requests"}`` with 400 on failure, ``/init_weights_update_group`` and
``/update_weights_from_distributed`` ``{"success", "message"}``, ``/pause_generation`` / ``/continue_generation``
``{"message", "status": "ok"}``, ``/get_server_info`` = server arguments + scheduler info + ``internal_states``
+ ``version``, generate errors as ``{"error": {"message"}}`` 400; ``managers/io_struct.py`` (commit 001067ff):
``UpdateWeightFromDiskReqInput`` (``weight_version: Optional[str]``), ``UpdateWeightsFromDistributedReqInput``
(names, dtypes, shapes, group_name, flush_cache, weight_version), ``InitWeightsUpdateGroupReqInput``
(master_address, master_port, rank_offset, world_size, group_name, backend); ``managers/tokenizer_manager.py``
(commit 001067ff): ``meta_info`` = id, finish_reason, prompt_tokens, weight_version (``ServerArgs.weight_version``,
default ``"default"``), num_retractions, reasoning_tokens, completion_tokens, cached_tokens, and
``utils/weight_versions.py`` (commit 19f93835): ``weight_versions`` spans; ``managers/schedule_batch.py``
(commit 000eaffa): ``FINISH_MATCHED_TOKEN`` / ``FINISH_LENGTH`` / ``FINISH_ABORT`` ``to_json`` forms;
``utils`` ``add_api_key_middleware``: every route but ``/health*`` needs ``Authorization: Bearer KEY``, else
401 ``{"error": "Unauthorized"}``. Like SGLang it has no ``/end_trajectories`` (404, FastAPI's
``{"detail": "Not Found"}``) and no glm5 engine counters. Requests carry ``input_ids`` (a server started with
``--skip-tokenizer-init``: no ``text`` in the response).

The pause / flush / weight-update state machine is SGLang's own, written from sglang 0.5.23 and 0.5.15.post1
(``pip download sglang==X --no-deps``), not glm5-core's: ``managers/tokenizer_manager.py``
``TokenizerManager.pause_generation`` (``abort``, the default mode of ``io_struct.PauseGenerationReqInput``:
abort every request, wait until none is in flight; ``in_place`` / ``retract`` go to the scheduler) and
``generate_request`` (new requests wait on ``is_pause_cond`` while paused); ``managers/scheduler.py``
``Scheduler.pause_generation`` (``in_place`` leaves the running batch as it is; ``retract`` moves the running
requests back to the waiting queue), ``is_fully_idle`` / ``flush_cache`` (0.5.23: idle = nothing running and, unless
paused (``ignore_waiting``), nothing waiting; 0.5.15.post1: nothing running nor waiting, paused or not) and
``scheduler_components/weight_updater.py`` ``update_weights_from_disk`` (the weights load, then the flush: 0.5.23
``flush_cache_after_weight_update`` answers ``success False`` with "Weights were updated, but the cache was not
flushed because requests are still running or queued. ..." (HTTP 400); 0.5.15.post1 ``assert
flush_cache_success, "Cache flush failed after updating weights"`` kills the scheduler, and with it the server).
Generation itself (the tokens, and freezing / aborting a request) is still glm5-core's ``RolloutEngine``.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import parse_generate_request


@dataclasses.dataclass
class ServerArgs:  # the fields of sglang.srt.server_args.ServerArgs a client may read back
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    api_key: Optional[str] = None
    weight_version: str = "default"
    tp_size: int = 1
    dp_size: int = 1
    skip_tokenizer_init: bool = True
    max_running_requests: Optional[int] = None


SGLANG_VERSIONS = ("0.5.23", "0.5.15.post1")  # whose scheduler behaviour the stand-in plays
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


class SGLangStandIn:
    def __init__(self, engine: RolloutEngine, model_path: str, *, api_key: Optional[str] = None,
                 sglang_version: str = "0.5.23"):
        if sglang_version not in SGLANG_VERSIONS:
            raise ValueError(f"sglang_version: expected one of {SGLANG_VERSIONS}, got {sglang_version!r}")
        self.sglang_version = sglang_version
        self.engine = engine
        self._cond = threading.Condition()  # TokenizerManager.is_pause_cond
        self.paused = False  # TokenizerManager.is_pause / Scheduler._engine_paused
        self._inflight: dict[Any, str] = {}  # requests past the pause gate, not finished: future -> rid
        self._retracted: set = set()  # in the waiting queue (retract), holding no KV
        self.dead = False  # 0.5.15's scheduler asserted: the server is gone
        self.refused_flushes = 0
        self.args = ServerArgs(model_path=model_path, api_key=api_key, max_running_requests=engine.max_batch)
        self.versions: dict[int, str] = {engine.version: "default"}  # engine int -> SGLang string
        self.calls = []  # (route, body) of every POST, for tests
        self._groups: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.args.port = self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.args.port}"

    def start(self) -> SGLangStandIn:
        self.engine.start()
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._httpd.shutdown()
        self._httpd.server_close()
        for group in self._groups.values():
            group.close()

    # -- SGLang semantics -------------------------------------------------------------------------------------
    def _set_version(self, label: Optional[str]) -> int:
        version = self.engine.newest_version + 1
        if label is not None:
            self.args.weight_version = label
        self.versions[version] = self.args.weight_version
        return version

    # -- the scheduler's pause / flush / update state machine (SGLang's, see the module docstring) ------------
    def _is_fully_idle(self) -> bool:
        running = [f for f in self._inflight if not f.done() and f not in self._retracted]
        waiting = [f for f in self._inflight if not f.done() and f in self._retracted]
        if self.sglang_version == "0.5.23":
            return not running and (self.paused or not waiting)  # is_fully_idle(ignore_waiting=paused)
        return not running and not waiting

    def flush_cache(self) -> bool:
        with self._cond:
            if not self._is_fully_idle():
                self.refused_flushes += 1
                return False
        self.engine.prefix_cache.flush()
        return True

    def pause(self, mode: str) -> None:
        with self._cond:
            self.paused = True
            if mode == "in_place":
                self.engine.pause("in_place")  # the running batch stays; the event loop stops
                return
            if mode == "retract":
                self.engine.pause("in_place")
                self._retracted.update(self._inflight)  # back to the waiting queue
                return
            inflight = list(self._inflight)
        for future in inflight:  # abort: abort_request(abort_all=True) until nothing holds model_update_lock
            self.engine.abort(future)
        deadline = time.monotonic() + 60
        with self._cond:
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(0.05)

    def resume(self) -> None:
        with self._cond:
            self.paused = False
            self._retracted.clear()
            self.engine.resume()
            self._cond.notify_all()

    def die(self) -> None:
        """0.5.15.post1: the scheduler's assert ended the process (every connection goes with it)."""
        self.dead = True
        for future in list(self._inflight):
            self.engine.abort(future)
        threading.Thread(target=self._httpd.shutdown, daemon=True).start()

    def generate(self, body: dict):
        try:
            request = parse_generate_request(body, self.engine.limits)
        except ValueError as exc:
            return 400, {"error": {"message": str(exc)}}
        started = time.monotonic()
        with self._cond:
            while self.paused and not self.dead:  # generate_request waits on is_pause_cond
                self._cond.wait(0.05)
            future = self.engine.submit(request)
            self._inflight[future] = request.rid
        try:
            result = future.result(timeout=600)
        except concurrent.futures.CancelledError:  # aborted while waiting for a slot: nothing sampled
            from glm5_core.rl.serving.engine import GenerateResult

            result = GenerateResult(request.rid, [], [], [], "abort", len(request.input_ids), 0)
        finally:
            with self._cond:
                self._inflight.pop(future, None)
                self._retracted.discard(future)
                self._cond.notify_all()
        if self.dead:
            return None, None
        n = len(result.output_ids)
        spans = []
        for i, v in enumerate(result.versions):
            name = self.versions[v]
            if spans and spans[-1]["version"] == name:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": name, "start": i, "end": i + 1})
        finish = {"stop": {"type": "stop", "matched": result.output_ids[-1] if n else None},
                  "length": {"type": "length", "length": n},
                  "abort": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}}
        meta = {"id": request.rid, "finish_reason": finish[result.finish_reason], "prompt_tokens": result.prompt_tokens,
                "weight_version": spans[-1]["version"] if spans else self.args.weight_version,
                "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": n,
                "cached_tokens": result.cached_tokens, "e2e_latency": time.monotonic() - started}
        if spans:
            meta["weight_versions"] = spans
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids)]
        return 200, {"output_ids": list(result.output_ids), "meta_info": meta}

    def update_from_disk(self, body: dict):
        from glm5_core.model import load_pretrained

        try:
            state = load_pretrained(body["model_path"]).state_dict()
            with self._lock:
                version = self._set_version(body.get("weight_version"))
                self.engine.update_weights(state, version, wait=60)
        except Exception as exc:  # SGLang reports a failed load as success false, 400
            return 400, {"success": False, "message": f"Failed to update weights: {exc}.", "num_paused_requests": 0}
        if body.get("flush_cache", True) and not self.flush_cache():
            if self.sglang_version == "0.5.15.post1":  # assert flush_cache_success: the scheduler dies
                self.die()
                return None, None
            return 400, {"success": False, "message": NOT_FLUSHED, "num_paused_requests": 0}
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def init_group(self, body: dict):
        from glm5_core.rl.serving.weight_group import WeightUpdateGroup

        try:
            self._groups[body.get("group_name", "weight_update_group")] = WeightUpdateGroup(
                master_address=body["master_address"], master_port=body["master_port"], rank=body["rank_offset"],
                world_size=body["world_size"], group_name=body.get("group_name", "weight_update_group"),
                backend=body.get("backend", "nccl"), device_host="127.0.0.1")
        except Exception as exc:
            return 400, {"success": False, "message": f"Failed to init group: {exc}."}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, body: dict):
        import torch

        group = self._groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return 400, {"success": False, "message": "Group not found. Call init_weights_update_group first."}
        tensors = group.receive(body["shapes"], [getattr(torch, d) for d in body["dtypes"]], "cpu")
        with self._lock:
            version = self._set_version(body.get("weight_version"))
            self.engine.update_weights(dict(zip(body["names"], tensors)), version, partial=True, wait=60)
        if body.get("flush_cache", True):
            self.engine.prefix_cache.flush()
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def server_info(self) -> dict:
        return {**dataclasses.asdict(self.args), "max_total_num_tokens": self.engine.max_batch * self.engine.max_len,
                "max_req_input_len": self.engine.limits.max_input_tokens,
                "internal_states": [{"last_gen_throughput": 0.0}], "version": "0.0.0-standin"}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                return

            def _send(self, status: Optional[int], body: Any = None, text: Optional[str] = None) -> None:
                if status is None:  # the server died: the connection drops unanswered
                    self.close_connection = True
                    return
                data = text.encode() if text is not None else (b"" if body is None else json.dumps(body).encode())
                self.send_response(status)
                if body is not None:
                    self.send_header("Content-Type", "application/json")
                elif text is not None:
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                key = server.args.api_key
                if key is None or self.path.startswith("/health"):
                    return True
                if self.headers.get("Authorization") == f"Bearer {key}":
                    return True
                self._send(401, {"error": "Unauthorized"})
                return False

            def do_GET(self):
                if not self._authorized():
                    return
                if self.path in ("/health", "/health_generate"):
                    self._send(200 if server.engine.healthy() else 503)
                elif self.path == "/get_server_info":
                    self._send(200, server.server_info())
                elif self.path == "/get_weight_version":
                    self._send(200, {"weight_version": server.args.weight_version})
                elif self.path == "/flush_cache":
                    self.do_POST()
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                if not self._authorized():
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                server.calls.append((self.path, body))
                if self.path == "/generate":
                    self._send(*server.generate(body))
                elif self.path == "/update_weights_from_disk":
                    self._send(*server.update_from_disk(body))
                elif self.path == "/init_weights_update_group":
                    self._send(*server.init_group(body))
                elif self.path == "/update_weights_from_distributed":
                    self._send(*server.update_from_distributed(body))
                elif self.path == "/flush_cache":
                    if server.flush_cache():
                        self._send(200, text="Cache flushed.\nPlease check backend logs for more details. (When "
                                             "there are running or waiting requests, the operation will not be "
                                             "performed.)\n")
                    else:
                        self._send(400, text="Flush cache failed.\n")
                elif self.path == "/pause_generation":
                    mode = body.get("mode", "abort")
                    if mode not in ("abort", "retract", "in_place"):  # Literal[...]: FastAPI's 422
                        self._send(422, {"detail": [{"loc": ["body", "mode"], "msg": "invalid mode"}]})
                        return
                    server.pause(mode)
                    self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
                elif self.path == "/continue_generation":
                    server.resume()
                    self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
                elif self.path == "/destroy_weights_update_group":
                    group = server._groups.pop(body.get("group_name", "weight_update_group"), None)
                    if group is not None:
                        group.close()
                    self._send(200 if group else 400, {"success": group is not None, "message": ""})
                else:
                    self._send(404, {"detail": "Not Found"})

        return Handler
