"""A stand-in SGLang server for tests, written from SGLang's own source (``pip download sglang==0.5.23 --no-deps``
and ``sglang==0.5.15.post1``), run as its own process as SGLang is: ``python -m tests.rl.serving.sglang_standin
--model-path DIR [--sglang-version 0.5.23|0.5.15.post1] [--api-key KEY]`` prints its URL on its first line.
It imports nothing of glm5-core but the model (``glm5_core.model``: the forward pass and checkpoint reading); its
HTTP handling, request parsing, scheduler, sampling loop, weight updates and process groups are its own, after
these files (``python/sglang/...`` in the wheels, both versions unless said):

* ``srt/entrypoints/http_server.py``: the routes and bodies: ``/health`` an empty 200; ``/generate``; the
  weight routes ``{"success", "message"}`` with 400 on failure (``/update_weights_from_disk`` adds
  ``num_paused_requests``); ``/pause_generation`` / ``/continue_generation`` ``{"message", "status": "ok"}``;
  ``/flush_cache`` plain text (400 "Flush cache failed." while requests run); ``/get_server_info``,
  ``/get_weight_version``; 0.5.23 only: ``/begin_weight_update`` / ``/end_weight_update`` (0.5.15.post1 has no
  such routes: FastAPI's 404 ``{"detail": "Not Found"}``); ``add_api_key_middleware``: every route but
  ``/health*`` needs ``Authorization: Bearer KEY``, else 401 ``{"error": "Unauthorized"}``.
* the request contract. 0.5.23: ``srt/entrypoints/api_contract.py`` + ``api/v1/api_types.py``
  (``GenerateRequest``: unknown top-level keys ignored; ``SamplingParams``: unknown keys refused with serde's
  "unknown field `x`, expected one of ..." as 400 ``{"error": "<text>"}``), then ``TokenizerManager``'s checks
  (input ids within the vocabulary, the context length) as 400 ``{"error": {"message"}}``. 0.5.15.post1 has no
  contract gate: the top-level keys go through FastAPI's dataclass parse (unknown ones ignored) and the sampling
  keys into ``SamplingParams(**kwargs)`` (a msgspec ``Struct``), whose ``TypeError`` no handler catches: 500
  "Internal Server Error". ``max_new_tokens`` defaults to 128 (``SamplingParams``).
* ``srt/managers/tokenizer_manager.py``: ``generate_request`` (a new request waits while ``is_pause``, then holds
  ``model_update_lock``'s reader side until it finishes), ``pause_generation`` (``abort``, the default mode:
  ``is_pause``, abort every request, wait until no request holds the lock; ``in_place`` / ``retract``: to the
  scheduler), ``continue_generation``, ``update_weights_from_disk`` / ``update_weights_from_distributed`` (the
  writer side of ``model_update_lock`` unless paused, so an update waits for running requests unless the
  engine is paused); the response (``--skip-tokenizer-init``: ``{"output_ids", "meta_info"}``, no ``text``):
  ``meta_info`` id, finish_reason, prompt_tokens, weight_version, completion_tokens, cached_tokens, and with
  ``return_logprob`` ``output_token_logprobs`` ``[[logprob, token_id, None], ...]``. 0.5.23 adds
  ``weight_versions`` spans (``srt/utils/weight_versions.py`` ``compute_weight_version_spans``: the version of
  each run of output tokens); 0.5.15.post1 has none.
* ``srt/managers/scheduler.py`` / ``schedule_batch.py``: the waiting queue and running batch (``max_running_
  requests``), ``pause_generation`` (``in_place``: the event loop stops with the batch as it is; ``retract``:
  running requests back to the waiting queue), ``is_fully_idle`` / ``flush_cache`` (0.5.23: nothing running and,
  unless paused, nothing waiting; 0.5.15.post1: nothing running nor waiting), ``FINISH_MATCHED_TOKEN`` /
  ``FINISH_LENGTH`` / ``FINISH_ABORT`` ``to_json``; ``srt/layers/sampler.py``: output log-probs are
  ``log_softmax(logits / temperature)``, greedy below a temperature of 1e-5.
* ``srt/managers/scheduler_components/weight_updater.py``: after an update the cache is flushed; 0.5.23
  ``flush_cache_after_weight_update`` answers success false (HTTP 400) "Weights were updated, but the cache was
  not flushed ..." when requests still run or wait, 0.5.15.post1 asserts ``flush_cache_success`` and the
  scheduler dies with the server (this process exits). 0.5.23's ``update_weights_from_distributed`` outside a
  ``begin_weight_update`` ... ``end_weight_update`` session answers 400 "update_weights_from_distributed must run
  between begin_weight_update() and end_weight_update()".
* ``srt/utils/common.py`` ``init_custom_process_group`` and ``srt/model_executor/model_runner_components/
  weight_updater.py`` ``init_weights_update_group`` / ``receive_weights_from_distributed`` /
  ``destroy_weights_update_group``: the group joined through torch's ``rendezvous`` (``tcp://``), a
  ``PrefixStore(group_name)`` and ``_new_process_group_helper``; one async ``broadcast(src=0)`` per tensor.

Generation is a greedy / sampling loop of its own over ``glm5_core.model``'s forward (the whole sequence each
step, no KV cache: the stand-in's cache is only the flush state machine). Not reproduced: batch input, streaming,
text prompts, the OpenAI routes. The routes ``/standin/state`` and ``/standin/save_weights`` exist for tests only
(SGLang has neither).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import select
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

SGLANG_VERSIONS = ("0.5.23", "0.5.15.post1")
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")
NO_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                   "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                   "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
                   "sampling_seed", "custom_params", "beam_width", "watermark", "choice")  # api_types 0.5.23
TOP_K_ALL = 1 << 30


class ContractError(ValueError):
    """0.5.23 ``JsonContractError``: 400 ``{"error": text}``."""


class Internal(Exception):
    """An exception SGLang's handlers do not catch: Starlette's 500 "Internal Server Error"."""


# -- the request contract -------------------------------------------------------------------------------------
def _unexpected(v: Any) -> str:  # serde's Unexpected display (api_types._unexpected)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return {list: "sequence", dict: "map"}.get(type(v), type(v).__name__)


def _expect(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_generate(body: Any, version: str) -> dict:
    """The fields of a single ``/generate`` request the stand-in serves, as SGLang parses them."""
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    ids = body.get("input_ids")
    if ids is None or not isinstance(ids, list) or (ids and isinstance(ids[0], list)):
        raise ContractError("the stand-in serves single input_ids requests (no text, no batch)")
    for x in ids:
        _expect(_is_int(x), x, "i64")
    sp = body.get("sampling_params") or {}
    _expect(isinstance(sp, dict), sp, "struct SamplingParams")
    if version == "0.5.23":
        for key in sp:
            if key not in SAMPLING_FIELDS:
                listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
                raise ContractError(f"unknown field `{key}`, expected one of {listed}")
    else:  # SamplingParams(**kwargs): a TypeError nothing catches
        unknown = [k for k in sp if k not in SAMPLING_FIELDS]
        if unknown:
            raise Internal(f"Unexpected keyword argument '{unknown[0]}'")
    out = {"rid": body.get("rid") or uuid.uuid4().hex, "input_ids": list(ids),
           "return_logprob": bool(body.get("return_logprob") or False)}
    for key, default, check, expected in (
            ("max_new_tokens", 128, _is_int, "i64"), ("temperature", 1.0, lambda v: _is_int(v) or isinstance(
                v, float), "f64"), ("top_p", 1.0, lambda v: _is_int(v) or isinstance(v, float), "f64"),
            ("top_k", TOP_K_ALL, _is_int, "i64"), ("ignore_eos", False, lambda v: isinstance(v, bool), "a boolean"),
            ("sampling_seed", None, _is_int, "i64")):
        value = sp.get(key)
        if value is not None:
            _expect(check(value), value, expected)
        out[key] = default if value is None else value
    stop = sp.get("stop_token_ids") or []
    _expect(isinstance(stop, list) and all(_is_int(x) for x in stop), stop, "a sequence of i64")
    out["stop_token_ids"] = set(stop)
    if out["top_k"] == -1:
        out["top_k"] = TOP_K_ALL
    return out


# -- the scheduler ---------------------------------------------------------------------------------------------
class Req:
    def __init__(self, p: dict):
        self.__dict__.update(p)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[str] = []  # the weight version that sampled each output token
        self.finish: Optional[dict] = None
        self.done = threading.Event()
        self.created = time.monotonic()


class RWLock:
    """``model_update_lock``: generate requests read, weight updates write."""

    def __init__(self):
        self._cond = threading.Condition()
        self.readers = 0
        self.writer = False

    def acquire_read(self):
        with self._cond:
            self._cond.wait_for(lambda: not self.writer)
            self.readers += 1

    def release_read(self):
        with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    def acquire_write(self):
        with self._cond:
            self._cond.wait_for(lambda: not self.writer and self.readers == 0)
            self.writer = True

    def release_write(self):
        with self._cond:
            self.writer = False
            self._cond.notify_all()


def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None, device_id=None):
    """sglang 0.5.23 ``srt/utils/common.py`` ``init_custom_process_group`` (torch >= 2.6: ``backend_options``)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      backend_options=pg_options, timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class StandIn:
    def __init__(self, model_path: str, version: str, api_key: Optional[str], max_running_requests: int = 8):
        from glm5_core.model import load_pretrained

        if version not in SGLANG_VERSIONS:
            raise ValueError(f"--sglang-version: expected one of {SGLANG_VERSIONS}, got {version!r}")
        self.version = version
        self.api_key = api_key
        self.model_path = model_path
        self.model = load_pretrained(model_path).eval()
        self.vocab_size = self.model.config.vocab_size
        self.context_len = self.model.config.max_position_embeddings
        self.weight_version = "default"  # ServerArgs.weight_version
        self.max_running = max_running_requests
        self.cond = threading.Condition()  # the scheduler's queues, is_pause_cond
        self.is_pause = False  # TokenizerManager.is_pause
        self.engine_paused = False  # Scheduler._engine_paused (in_place / retract)
        self.waiting: collections.deque = collections.deque()
        self.running: list[Req] = []
        self.update_lock = RWLock()
        self.model_lock = threading.Lock()  # the event loop's step vs a weight load
        self.groups: dict[str, Any] = {}
        self.session = False  # 0.5.23 _WeightUpdateSession
        self.calls: list[str] = []
        self.refused_flushes = 0
        threading.Thread(target=self._event_loop, daemon=True).start()

    # -- the event loop: one decode step for every running request ----------------------------------------
    def _event_loop(self) -> None:
        import torch

        while True:
            with self.cond:
                while self.engine_paused or not (self.waiting or self.running):
                    self.cond.wait()
                while self.waiting and len(self.running) < self.max_running:
                    self.running.append(self.waiting.popleft())
                batch = list(self.running)
            with self.model_lock, torch.no_grad():
                for req in batch:
                    if req.finish is None:
                        self._decode_one(req, torch)
            with self.cond:
                for req in batch:
                    if req.finish is not None and req in self.running:
                        self.running.remove(req)
                        req.done.set()
                self.cond.notify_all()

    def _decode_one(self, req: Req, torch) -> None:
        ids = torch.tensor([req.input_ids + req.output_ids])
        logits = self.model(ids).logits[0, -1].float()
        greedy = req.temperature < 1e-5
        logprobs = torch.log_softmax(logits if greedy else logits / req.temperature, dim=-1)
        if greedy:
            token = int(torch.argmax(logits))
        else:
            probs = logprobs.exp()
            if req.top_k < probs.numel():
                kth = torch.topk(probs, req.top_k).values[-1]
                probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            if req.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                cut = torch.cumsum(sorted_p, 0) - sorted_p > req.top_p
                probs = probs.clone()
                probs[order[cut]] = 0
            gen = None
            if req.sampling_seed is not None:
                gen = torch.Generator().manual_seed(req.sampling_seed * 1000003 + len(req.output_ids))
            token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        req.output_ids.append(token)
        req.logprobs.append(float(logprobs[token]))
        req.versions.append(self.weight_version)
        n = len(req.output_ids)
        if not req.ignore_eos and token in req.stop_token_ids:
            req.finish = {"type": "stop", "matched": token}
        elif n >= req.max_new_tokens or len(req.input_ids) + n >= self.context_len:
            req.finish = {"type": "length", "length": n}

    # -- TokenizerManager ---------------------------------------------------------------------------------
    def generate(self, body: Any) -> tuple[int, Any]:
        try:
            p = parse_generate(body, self.version)
        except ContractError as exc:
            return 400, {"error": str(exc)}
        bad = [x for x in p["input_ids"] if x >= self.vocab_size or x < 0]
        if bad:
            return 400, {"error": {"message": f"The input_ids {p['input_ids']} contains values greater than the "
                                              f"vocab size ({self.vocab_size})."}}
        n_in = len(p["input_ids"])
        if n_in >= self.context_len:
            return 400, {"error": {"message": f"The input ({n_in} tokens) is longer than the model's context "
                                              f"length ({self.context_len} tokens)."}}
        req = Req(p)
        with self.cond:
            self.cond.wait_for(lambda: not self.is_pause)  # generate_request waits on is_pause_cond
        self.update_lock.acquire_read()
        try:
            with self.cond:
                if req.max_new_tokens <= 0:
                    req.finish = {"type": "length", "length": 0}
                else:
                    self.waiting.append(req)
                    self.cond.notify_all()
            if req.finish is None:
                req.done.wait()
        finally:
            self.update_lock.release_read()
        return 200, self._response(req)

    def _response(self, req: Req) -> dict:
        n = len(req.output_ids)
        meta = {"id": req.rid, "finish_reason": req.finish, "prompt_tokens": len(req.input_ids),
                "weight_version": self.weight_version, "completion_tokens": n, "cached_tokens": 0,
                "e2e_latency": time.monotonic() - req.created}
        if self.version == "0.5.23" and n:
            spans: list[dict] = []
            for i, v in enumerate(req.versions):  # compute_weight_version_spans
                if spans and spans[-1]["version"] == v:
                    spans[-1]["end"] = i + 1
                else:
                    spans.append({"version": v, "start": i, "end": i + 1})
            meta["weight_versions"] = spans
            meta["weight_version"] = spans[-1]["version"]
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
        return {"output_ids": list(req.output_ids), "meta_info": meta}

    def abort_all(self) -> None:
        """``abort_request(abort_all=True)``; handled between two event-loop steps, as the scheduler does."""
        with self.model_lock, self.cond:
            for req in list(self.waiting) + list(self.running):
                if req.finish is None:
                    req.finish = {"type": "abort", "message": "Abort all requests.", "status_code": None,
                                  "err_type": None}
                req.done.set()
            self.waiting.clear()
            self.running.clear()
            self.cond.notify_all()

    def pause(self, mode: str) -> None:
        with self.cond:
            self.is_pause = True
            if mode == "in_place":
                self.engine_paused = True
                return
            if mode == "retract":
                self.engine_paused = True
                self.waiting.extendleft(reversed(self.running))
                self.running.clear()
                return
        while True:  # abort: abort_request(abort_all=True) until no request holds model_update_lock
            self.abort_all()
            with self.update_lock._cond:
                if self.update_lock.readers == 0:
                    return
            time.sleep(0.05)

    def resume(self) -> None:
        with self.cond:
            self.is_pause = False
            self.engine_paused = False
            self.cond.notify_all()

    def is_fully_idle(self) -> bool:
        with self.cond:
            running = [r for r in self.running if r.finish is None]
            if self.version == "0.5.23":
                return not running and (self.engine_paused or not self.waiting)
            return not running and not self.waiting

    def flush_cache(self) -> bool:
        if not self.is_fully_idle():
            self.refused_flushes += 1
            return False
        return True

    def _after_update(self, flush: bool, ok_message: str, extra: dict) -> tuple[int, Any]:
        if flush and not self.flush_cache():
            if self.version == "0.5.15.post1":  # assert flush_cache_success: the scheduler dies, the server too
                sys.stderr.write("AssertionError: Cache flush failed after updating weights\n")
                sys.stderr.flush()
                os._exit(1)
            return 400, {"success": False, "message": NOT_FLUSHED, **extra}
        return 200, {"success": True, "message": ok_message, **extra}

    def _locked_update(self, fn):
        """The writer side of model_update_lock unless paused, then the load between two event-loop steps."""
        with self.cond:
            paused = self.is_pause
        if not paused:
            self.update_lock.acquire_write()
        try:
            with self.model_lock:
                return fn()
        finally:
            if not paused:
                self.update_lock.release_write()

    def _load(self, named: dict) -> None:
        params = dict(self.model.state_dict())
        for name, tensor in named.items():
            if name not in params:
                raise KeyError(f"unknown weight {name}")
            params[name].copy_(tensor)

    def update_from_disk(self, body: dict) -> tuple[int, Any]:
        from safetensors.torch import load_file

        def load():
            files = sorted(glob.glob(os.path.join(body["model_path"], "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no safetensors under {body['model_path']}")
            state = {}
            for f in files:
                state.update(load_file(f))
            self._load(state)

        try:
            self._locked_update(load)
        except Exception as exc:
            return 400, {"success": False, "message": f"Failed to update weights: {exc}.\nRolling back to "
                                                       f"original weights.", "num_paused_requests": 0}
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return self._after_update(body.get("flush_cache", True), "Succeeded to update model weights.",
                                  {"num_paused_requests": 0})

    def init_group(self, body: dict) -> tuple[int, Any]:
        host, port = body["master_address"], body["master_port"]
        init_method = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        try:
            self.groups[body.get("group_name", "weight_update_group")] = init_custom_process_group(
                backend=body.get("backend", "nccl"), init_method=init_method, world_size=body["world_size"],
                rank=body["rank_offset"] + 0, group_name=body.get("group_name", "weight_update_group"),
                timeout=datetime.timedelta(seconds=120))
        except Exception as exc:
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, body: dict) -> tuple[int, Any]:
        import torch
        import torch.distributed as dist

        if self.version == "0.5.23" and not self.session:
            return 400, {"success": False, "message": NO_SESSION}
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return 400, {"success": False, "message": f"Group {name} not in {list(self.groups)}. Please call "
                                                      f"`init_weights_update_group` first."}

        def receive():
            weights, handles = {}, []
            for n, d, s in zip(body["names"], body["dtypes"], body["shapes"]):
                weights[n] = torch.empty(s, dtype=getattr(torch, d))
                handles.append(dist.broadcast(weights[n], src=0, group=self.groups[name], async_op=True))
            for h in handles:
                h.wait()
            self._load(weights)

        try:
            self._locked_update(receive)
        except Exception as exc:
            return 400, {"success": False, "message": f"Failed to update parameter online: {exc}."}
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return self._after_update(body.get("flush_cache", True), "Succeeded to update parameter online.", {})

    def destroy_group(self, body: dict) -> tuple[int, Any]:
        import torch.distributed as dist

        pg = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(pg)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def session_call(self, begin: bool) -> tuple[int, Any]:
        if begin and self.session:
            return 400, {"success": False, "message": "a weight-update session is already open; call "
                                                      "end_weight_update() first"}
        if not begin and not self.session:
            return 400, {"success": False, "message": "no weight-update session is open; call "
                                                      "begin_weight_update() first"}
        self.session = begin
        return 200, {"success": True, "message": "Success"}

    def server_info(self) -> dict:
        return {"model_path": self.model_path, "weight_version": self.weight_version, "skip_tokenizer_init": True,
                "tp_size": 1, "dp_size": 1, "max_running_requests": self.max_running,
                "internal_states": [{"last_gen_throughput": 0.0}], "version": self.version}

    def save_weights(self, path: str) -> None:
        from safetensors.torch import save_file

        with self.model_lock:
            save_file({k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}, path)


def handler_for(server: StandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            return

        def _send(self, status: int, body: Any = None, text: Optional[str] = None) -> None:
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
            if server.api_key is None or self.path.startswith("/health"):
                return True
            if self.headers.get("Authorization") == f"Bearer {server.api_key}":
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def do_GET(self):
            if not self._authorized():
                return
            if self.path in ("/health", "/health_generate"):
                self._send(200)
            elif self.path == "/get_server_info":
                self._send(200, server.server_info())
            elif self.path == "/get_weight_version":
                self._send(200, {"weight_version": server.weight_version})
            elif self.path == "/standin/state":
                self._send(200, {"calls": server.calls, "refused_flushes": server.refused_flushes,
                                 "weight_version": server.weight_version, "session": server.session,
                                 "running": len(server.running),
                                 "glm5_rl_modules": sorted(m for m in sys.modules if m.startswith("glm5_core.rl"))})
            elif self.path == "/flush_cache":
                self.do_POST()
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            if not self._authorized():
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length)) if length else {}
            except ValueError:
                self._send(400, {"object": "error", "message": "invalid JSON", "type": "Bad Request", "code": 400})
                return
            path = self.path
            routes = {"/generate": server.generate, "/update_weights_from_disk": server.update_from_disk,
                      "/init_weights_update_group": server.init_group,
                      "/update_weights_from_distributed": server.update_from_distributed,
                      "/destroy_weights_update_group": server.destroy_group}
            if server.version == "0.5.23":
                routes["/begin_weight_update"] = lambda b: server.session_call(True)
                routes["/end_weight_update"] = lambda b: server.session_call(False)
            if path.startswith("/standin/") or path in routes or path in (
                    "/flush_cache", "/pause_generation", "/continue_generation"):
                server.calls.append(path)
            if path in routes:
                try:
                    self._send(*routes[path](body))
                except Internal:
                    self._send(500, text="Internal Server Error")
            elif path == "/flush_cache":
                if server.flush_cache():
                    self._send(200, text="Cache flushed.\nPlease check backend logs for more details. (When there "
                                         "are running or waiting requests, the operation will not be performed.)\n")
                else:
                    self._send(400, text="Flush cache failed.\n")
            elif path == "/pause_generation":
                mode = body.get("mode", "abort")
                if mode not in ("abort", "retract", "in_place"):
                    self._send(400, {"object": "error", "message": f"invalid mode {mode!r}", "type": "Bad Request",
                                     "code": 400})
                    return
                server.pause(mode)
                self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif path == "/continue_generation":
                server.resume()
                self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
            elif path == "/standin/save_weights":
                server.save_weights(body["path"])
                self._send(200, {"success": True})
            else:
                self._send(404, {"detail": "Not Found"})

    return Handler


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sglang_standin")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--sglang-version", default="0.5.23", choices=SGLANG_VERSIONS)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    server = StandIn(args.model_path, args.sglang_version, args.api_key)
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), handler_for(server))
    httpd.daemon_threads = True
    print(f"http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()
    return 0


# -- the test side: the stand-in as a child process ------------------------------------------------------------
class StandInProcess:
    """``python -m tests.rl.serving.sglang_standin`` as a child process; ``url`` once it listens."""

    def __init__(self, model_path: str, *, sglang_version: str = "0.5.23", api_key: Optional[str] = None,
                 port: int = 0, start_timeout: float = 120.0):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        cmd = [sys.executable, "-m", "tests.rl.serving.sglang_standin", "--model-path", str(model_path),
               "--sglang-version", sglang_version, "--port", str(port)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.api_key = api_key
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line.startswith("http://"):
            self.shutdown()
            raise RuntimeError(f"the SGLang stand-in did not start: {self.stderr()[-2000:]}")
        self.url = line

    def _call(self, method: str, route: str, body: Optional[dict] = None) -> dict:
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(self.url + route, data=data, method=method,
                                                           headers=headers), timeout=60) as r:
            return json.loads(r.read())

    def state(self) -> dict:
        return self._call("GET", "/standin/state")

    def save_weights(self, path: str) -> None:
        self._call("POST", "/standin/save_weights", {"path": str(path)})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        if self.alive():
            return ""
        return self.proc.stderr.read() if self.proc.stderr else ""

    def shutdown(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    sys.exit(main())
