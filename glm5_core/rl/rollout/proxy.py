"""OpenAI-compatible token-in-token-out proxy: an unmodified agent written against the ``openai`` package rolls
out trajectories that train on exactly the tokens the engine sampled.

Routes (on 127.0.0.1 only): ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``. The agent points its client at :attr:`OpenAIProxy.base_url`.

* Each request names its trajectory in the ``X-Trajectory-Id`` header or, without the header, the ``user`` field.
  The driver opens a trajectory (:meth:`OpenAIProxy.open_trajectory`) before starting its agent and closes it
  (:meth:`OpenAIProxy.close_trajectory`) when the episode is over, taking its recorded samples; a request for a
  trajectory that is not open is refused (``auto_open`` opens them on first use instead, for standalone serving;
  nobody closes those, so an auto-opened trajectory whose first request failed is closed at once, and one idle for
  ``idle_trajectory_timeout`` seconds is closed, its record dropped, when ``max_trajectories`` are open and a new
  one needs room).
  Requests of one trajectory are served one at a time, in arrival order.
* Chat requests are turned into token ids by the trajectory's :class:`ChatTranscript` (appending to the recorded
  ids while the agent's messages extend them; see that module), completion requests from their ``prompt`` (token
  ids as given; a string that extends the recorded text keeps the recorded ids and encodes only the rest).
* Every generation goes through the trajectory's :class:`TITOGateway` (``generate_fn`` routes it to an engine, as in
  the rollout runner): it records the prompt ids (loss mask 0) and the engine's sampled ids, log-probs and weight
  versions (loss mask 1), exactly as the engine returned them.
* Tools (``tools`` in the request) are rendered by the chat template; the model's tool-call text is parsed into
  ``message.tool_calls`` (:class:`ToolCallParser`) with ``finish_reason`` ``tool_calls``; ``role: tool`` messages are
  appended as context like any other message.
* Sampling stops on the tokenizer's end-of-turn ids plus ``stop`` strings that are single tokens (the engine stops
  on token ids). ``max_tokens`` defaults to ``default_max_tokens`` (capped by the room left in the context).
  ``temperature`` / ``top_p`` given to the proxy fix the sampling of every request (the trainer's setting: the
  recorded log-probs are of that distribution); a request asking for other values is refused, one that names
  none is sampled at them. Without them the request's values are used (default 1).
* The returned ``logprobs`` are the engine's, for the returned tokens (the end-of-turn token is not content).

Requests are untrusted: each must arrive whole within ``request_deadline`` seconds of its first byte (a client that
stalls or trickles is dropped; ``socket_timeout`` bounds the wait for the next request on a keep-alive connection),
a body a route does not read is discarded before the reply (``http_service.RequestHandler``, shared with the engine
server), bodies are capped (``max_body_bytes``, 413), JSON nesting is bounded (``max_json_depth``),
every field is checked (:mod:`openai_protocol`); errors are OpenAI's error body. Engine failures are 503 (the
engines could not serve: retry), inconsistent engine answers 502.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

from glm5_core.rl.rollout.chat_transcript import ChatTranscript
from glm5_core.rl.rollout.gateway import GenerateFn, TITOGateway
from glm5_core.rl.rollout.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    SamplingRequest,
    chat_completion,
    chat_token_logprob,
    completion_logprobs,
    model_list,
    parse_chat_request,
    parse_completion_request,
    parse_message,
    text_completion,
)
from glm5_core.rl.rollout.tokenizer import ChatTokenizer
from glm5_core.rl.rollout.tool_calls import ToolCallParser
from glm5_core.rl.serving.client import EngineRequestError, EngineUnavailable
from glm5_core.rl.serving.http_service import LOCALHOST, HTTPService, RequestHandler
from glm5_core.rl.serving.json_http import BodyError, ClientStalledError, parse_json_body
from glm5_core.rl.serving.sampling import check_top_p, check_training_temperature

TRAJECTORY_HEADER = "X-Trajectory-Id"
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_REQUEST_DEADLINE = 30.0  # seconds from a request's first byte to its last (the engine server's default)
MAX_TRAJECTORY_ID_CHARS = 256


@dataclasses.dataclass
class ProxyTrajectory:
    """One open trajectory: its gateway (the training record) and its chat transcript."""

    trajectory_id: str
    gateway: TITOGateway
    transcript: ChatTranscript
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    closed: bool = False
    auto_opened: bool = False  # opened by a request (``auto_open``), not by the driver
    last_used: float = dataclasses.field(default_factory=time.monotonic)  # when its last request ended


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    return value


class OpenAIProxy(HTTPService):
    """Serves ``tokenizer`` + ``generate_fn`` as an OpenAI API on 127.0.0.1:``port`` (0 = any free port).

    ``max_context_tokens`` is the engines' context length (prompt + completion); ``max_new_tokens`` the most
    tokens one request may ask for (the engines' cap)."""

    def __init__(self, tokenizer: ChatTokenizer, generate_fn: GenerateFn, *, max_context_tokens: int,
                 model_name: str = "glm5-core", default_max_tokens: int = 256, max_new_tokens: int = 1024,
                 port: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_json_depth: int = DEFAULT_MAX_JSON_DEPTH, socket_timeout: float = 30.0,
                 request_deadline: float = DEFAULT_REQUEST_DEADLINE,
                 max_connections: int = 256, max_trajectories: int = 4096, auto_open: bool = False,
                 idle_trajectory_timeout: float = 600.0,
                 tool_parser: Optional[ToolCallParser] = None, temperature: Optional[float] = None,
                 top_p: Optional[float] = None, return_routed_experts: bool = False,
                 return_indexer_topk: bool = False):
        if not isinstance(tokenizer, ChatTokenizer) or not tokenizer.has_chat_template:
            raise ValueError(f"tokenizer: expected a ChatTokenizer with a chat template, got {tokenizer!r:.80}")
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name: expected a non-empty str, got {model_name!r}")
        self.max_context_tokens = _check_int("max_context_tokens", max_context_tokens, 2)
        self.default_max_tokens = _check_int("default_max_tokens", default_max_tokens, 1)
        self.max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
        self.max_body_bytes = _check_int("max_body_bytes", max_body_bytes, 1)
        self.max_json_depth = _check_int("max_json_depth", max_json_depth, 2)
        self.max_trajectories = _check_int("max_trajectories", max_trajectories, 1)
        if not idle_trajectory_timeout > 0:
            raise ValueError(f"idle_trajectory_timeout: expected seconds > 0, got {idle_trajectory_timeout!r}")
        self.idle_trajectory_timeout = float(idle_trajectory_timeout)
        if not socket_timeout > 0:
            raise ValueError(f"socket_timeout: expected seconds > 0, got {socket_timeout!r}")
        self.socket_timeout = float(socket_timeout)
        if not request_deadline > 0:
            raise ValueError(f"request_deadline: expected seconds > 0, got {request_deadline!r}")
        self.request_deadline = float(request_deadline)
        self.temperature = None if temperature is None else check_training_temperature(temperature, "temperature")
        self.top_p = None if top_p is None else check_top_p(top_p)
        self.tokenizer = tokenizer
        self.generate_fn = generate_fn
        self.model_name = model_name
        self.auto_open = bool(auto_open)
        self.tool_parser = tool_parser or ToolCallParser()
        # replay traces asked of the engines and recorded per sample (train.routing_replay / index_replay)
        self.replay = {"return_routed_experts": bool(return_routed_experts),
                       "return_indexer_topk": bool(return_indexer_topk)}
        self.created = int(time.time())
        self._trajectories: dict[str, ProxyTrajectory] = {}
        self._lock = threading.Lock()
        super().__init__(self._handler_class(), host=LOCALHOST, port=port,
                         max_connections=_check_int("max_connections", max_connections, 1), thread_name="openai-proxy")

    @property
    def base_url(self) -> str:
        """What an ``openai.OpenAI(base_url=...)`` client takes."""
        return self.url + "/v1"

    def start(self) -> OpenAIProxy:
        self.serve_in_background()
        return self

    def shutdown(self) -> None:
        self.stop_serving()

    # -- trajectories ----------------------------------------------------------------------------------------
    def _evict_idle_locked(self) -> None:
        """Close the auto-opened trajectories no request has used for ``idle_trajectory_timeout`` seconds (nobody
        closes those; their records are dropped)."""
        now = time.monotonic()
        for trajectory_id, record in list(self._trajectories.items()):
            if not record.auto_opened or now - record.last_used < self.idle_trajectory_timeout:
                continue
            if record.lock.acquire(blocking=False):  # a request in flight keeps it
                try:
                    record.closed = True
                    del self._trajectories[trajectory_id]
                finally:
                    record.lock.release()

    def _open_locked(self, trajectory_id: str, *, auto: bool = False) -> ProxyTrajectory:
        if len(self._trajectories) >= self.max_trajectories:
            self._evict_idle_locked()
        if len(self._trajectories) >= self.max_trajectories:
            raise ValueError(f"trajectory_id: {self.max_trajectories} trajectories already open (max_trajectories)")
        record = ProxyTrajectory(trajectory_id, TITOGateway(trajectory_id, self.generate_fn, **self.replay),
                                 ChatTranscript(self.tokenizer), auto_opened=auto)
        self._trajectories[trajectory_id] = record
        return record

    def open_trajectory(self, trajectory_id: str) -> ProxyTrajectory:
        if not isinstance(trajectory_id, str) or not 1 <= len(trajectory_id) <= MAX_TRAJECTORY_ID_CHARS:
            raise ValueError(f"trajectory_id: expected a str of 1 to {MAX_TRAJECTORY_ID_CHARS} characters, "
                             f"got {trajectory_id!r:.80}")
        with self._lock:
            if trajectory_id in self._trajectories:
                raise ValueError(f"trajectory_id: {trajectory_id!r} is already open")
            return self._open_locked(trajectory_id)

    def close_trajectory(self, trajectory_id: str) -> ProxyTrajectory:
        """End the trajectory: it takes no more requests (one in flight finishes first). Its training record is
        ``.gateway.finished_samples()``."""
        with self._lock:
            record = self._trajectories.pop(trajectory_id, None)
        if record is None:
            raise ValueError(f"trajectory_id: {trajectory_id!r} is not open")
        with record.lock:
            record.closed = True
        return record

    def open_trajectories(self) -> list[str]:
        with self._lock:
            return list(self._trajectories)

    def _trajectory(self, header: Optional[str], request: SamplingRequest) -> ProxyTrajectory:
        trajectory_id = header if header is not None else request.user
        param = TRAJECTORY_HEADER if header is not None else "user"
        if not trajectory_id or len(trajectory_id) > MAX_TRAJECTORY_ID_CHARS:
            raise OpenAIError(f"every request names its trajectory: the {TRAJECTORY_HEADER} header or the user field "
                              f"(1 to {MAX_TRAJECTORY_ID_CHARS} characters), got {trajectory_id!r:.80}", param=param)
        with self._lock:
            record = self._trajectories.get(trajectory_id)
            if record is None and self.auto_open:
                try:
                    record = self._open_locked(trajectory_id, auto=True)
                except ValueError as exc:
                    raise OpenAIError(str(exc), status=429, type="rate_limit_error", param=param) from None
        if record is None:
            raise OpenAIError(f"trajectory {trajectory_id!r} is not open", status=404, param=param,
                              code="trajectory_not_found")
        return record

    # -- generation ----------------------------------------------------------------------------------------------
    def _check_model(self, request: SamplingRequest) -> None:
        if request.model != self.model_name:
            raise OpenAIError(f"The model {request.model!r} does not exist; this server serves {self.model_name!r}",
                              status=404, param="model", code="model_not_found")

    def _stop_ids(self, request: SamplingRequest) -> list[int]:
        ids = list(self.tokenizer.stop_token_ids)
        for text in request.stop:
            try:
                ids.append(self.tokenizer.token(text))
            except ValueError:
                raise OpenAIError(f"stop: each stop string must be one token of this tokenizer (the engine stops on "
                                  f"token ids), got {text!r:.80}", param="stop") from None
        return list(dict.fromkeys(ids))

    def _sampling(self, request: SamplingRequest) -> dict[str, float]:
        values = {}
        for name, fixed in (("temperature", self.temperature), ("top_p", self.top_p)):
            asked = getattr(request, name)
            if fixed is not None and asked is not None and asked != fixed:
                raise OpenAIError(f"{name}: this server samples every request at {name}={fixed} (the trainer's "
                                  f"setting), got {asked}", param=name)
            values[name] = fixed if fixed is not None else 1.0 if asked is None else asked
        return values

    def _new_tokens(self, request: SamplingRequest, prompt_len: int, param: str) -> int:
        room = self.max_context_tokens - prompt_len
        if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
            asked = "" if request.max_tokens is None else f" plus {request.max_tokens} completion tokens"
            raise OpenAIError(f"This model's maximum context length is {self.max_context_tokens} tokens; the request "
                              f"has {prompt_len} prompt tokens{asked}", param=param, code="context_length_exceeded")
        if request.max_tokens is None:
            return min(self.default_max_tokens, self.max_new_tokens, room)
        if request.max_tokens > self.max_new_tokens:
            raise OpenAIError(f"max_tokens: expected at most {self.max_new_tokens}, got {request.max_tokens}",
                              param="max_tokens")
        return request.max_tokens

    def _generate(self, record: ProxyTrajectory, input_ids: list[int], request: SamplingRequest,
                  stop_ids: list[int], param: str) -> dict:
        params = {**self._sampling(request), "max_new_tokens": self._new_tokens(request, len(input_ids), param),
                  "stop_token_ids": stop_ids}
        try:
            response = record.gateway.generate(input_ids, params)
        except EngineUnavailable as exc:
            raise OpenAIError(f"no engine could serve the request: {exc}", status=503, type="server_error",
                              code="engine_unavailable") from None
        except EngineRequestError as exc:
            status = 503 if exc.status >= 500 else 500
            raise OpenAIError(f"engine refused the request: {exc}", status=status, type="server_error") from None
        except ValueError as exc:  # the gateway found the engine's answer inconsistent
            raise OpenAIError(f"bad engine response: {exc}", status=502, type="server_error") from None
        if response["meta_info"]["finish_reason"]["type"] == "abort":
            raise OpenAIError("the engine aborted the generation", status=503, type="server_error",
                              code="engine_unavailable")
        return response

    def _split_stop(self, response: dict, stop_ids: list[int]) -> tuple[list[int], list[float], Optional[int]]:
        """(the returned tokens, their log-probs, the stop token the engine ended on or None)."""
        ids = [int(t) for t in response["output_ids"]]
        logprobs = [float(e[0]) for e in response["meta_info"]["output_token_logprobs"]]
        if response["meta_info"]["finish_reason"]["type"] == "stop" and ids and ids[-1] in stop_ids:
            return ids[:-1], logprobs[:-1], ids[-1]
        return ids, logprobs, None

    @staticmethod
    def _usage(response: dict, prompt_len: int) -> dict[str, Any]:
        return dict(prompt_tokens=prompt_len, completion_tokens=len(response["output_ids"]),
                    cached_tokens=response["meta_info"].get("cached_tokens"))

    @contextlib.contextmanager
    def _serving(self, header: Optional[str], request: SamplingRequest) -> Iterator[ProxyTrajectory]:
        """The open trajectory ``request`` names, held for it (its requests run one at a time)."""
        record = self._trajectory(header, request)
        with record.lock:
            if record.closed:
                raise OpenAIError(f"trajectory {record.trajectory_id!r} is closed", status=404,
                                  code="trajectory_not_found")
            try:
                yield record
            finally:
                record.last_used = time.monotonic()
                if record.auto_opened and record.gateway.num_requests == 0:  # its first request failed: nothing
                    record.closed = True  # was generated, nobody will close it; a retry opens it afresh
                    with self._lock:
                        if self._trajectories.get(record.trajectory_id) is record:
                            del self._trajectories[record.trajectory_id]

    def handle_chat(self, body: Any, trajectory_header: Optional[str] = None) -> dict[str, Any]:
        request: ChatRequest = parse_chat_request(body)
        self._check_model(request)
        stop_ids = self._stop_ids(request)
        with self._serving(trajectory_header, request) as record:
            try:
                prompt_ids = record.transcript.prompt_ids(request.messages, request.tools)
            except ValueError as exc:
                raise OpenAIError(f"messages: {exc}", param="messages") from None
            except Exception as exc:  # the template raised (raise_exception, a Jinja error): the request's fault
                raise OpenAIError(f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                                  param="messages") from None
            response = self._generate(record, prompt_ids, request, stop_ids, "messages")
            ids, logprobs, stop = self._split_stop(response, stop_ids)
            text = self.tokenizer.decode(ids)
            content, calls = self.tool_parser.parse(text) if request.tools else (text, [])
            finish = response["meta_info"]["finish_reason"]["type"]
            reason = "length" if finish == "length" else "tool_calls" if calls else "stop"
            try:
                assistant = parse_message({"role": "assistant", "content": content, "tool_calls": calls}, 0)
            except OpenAIError:  # the model's output, not the client's request: its text, without tool calls
                content, calls, reason = text, [], "stop" if finish != "length" else "length"
                assistant = parse_message({"role": "assistant", "content": content}, 0)
            record.transcript.record(request.messages, request.tools, prompt_ids, assistant, response["output_ids"],
                                     None if stop is None else self.tokenizer.token_text(stop))
        token_logprobs = None
        if request.logprobs:
            token_logprobs = [chat_token_logprob(self.tokenizer.token_text(t), lp) for t, lp in zip(ids, logprobs)]
        return chat_completion(model=self.model_name, content=content, tool_calls=calls, finish_reason=reason,
                               logprobs=token_logprobs, **self._usage(response, len(prompt_ids)))

    def _completion_prompt(self, record: ProxyTrajectory, prompt) -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if t >= self.tokenizer.min_vocab_size]
            if bad:
                raise OpenAIError(f"prompt: token ids must be below {self.tokenizer.min_vocab_size}, got {bad[0]}",
                                  param="prompt")
            return list(prompt)
        recorded = record.gateway.current.tokens
        done = self.tokenizer.decode(recorded, skip_special_tokens=False) if recorded else ""
        if recorded and prompt.startswith(done):  # extends what was recorded: keep the sampled ids as sampled
            return recorded + self.tokenizer.encode_with_control_tokens(prompt[len(done):])
        return self.tokenizer.encode_with_control_tokens(prompt)

    def handle_completion(self, body: Any, trajectory_header: Optional[str] = None) -> dict[str, Any]:
        request: CompletionRequest = parse_completion_request(body)
        self._check_model(request)
        stop_ids = self._stop_ids(request)
        with self._serving(trajectory_header, request) as record:
            prompt_ids = self._completion_prompt(record, request.prompt)
            response = self._generate(record, prompt_ids, request, stop_ids, "prompt")
        ids, logprobs, _ = self._split_stop(response, stop_ids)
        finish = "length" if response["meta_info"]["finish_reason"]["type"] == "length" else "stop"
        token_logprobs = None
        if request.logprobs:
            token_logprobs = completion_logprobs([self.tokenizer.token_text(t) for t in ids], logprobs)
        return text_completion(model=self.model_name, text=self.tokenizer.decode(ids), finish_reason=finish,
                               logprobs=token_logprobs, **self._usage(response, len(prompt_ids)))

    def handle_models(self) -> dict[str, Any]:
        return model_list([self.model_name], self.created)

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _handler_class(self):
        proxy = self

        class Handler(RequestHandler):
            socket_timeout = proxy.socket_timeout
            request_deadline = proxy.request_deadline
            max_body_bytes = proxy.max_body_bytes

            def _body(self) -> Any:
                return parse_json_body(self.body(), proxy.max_json_depth)

            def _serve(self, route) -> None:
                try:
                    self.reply(200, route())
                except ClientStalledError:  # nobody to answer
                    self.close_connection = True
                except BodyError as exc:  # 411 / 413 (the body unread: the connection closes), bad JSON
                    if exc.close:
                        self.close_connection = True
                    self.reply(exc.status, OpenAIError(str(exc), status=exc.status).body())
                except OpenAIError as exc:
                    self.reply(exc.status, exc.body())
                except Exception as exc:  # a bug here or in the engine path: report, keep serving
                    self.reply(500, OpenAIError(f"{type(exc).__name__}: {exc}", status=500,
                                                       type="server_error").body())

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/v1/models":
                    self._serve(proxy.handle_models)
                elif path == "/health":
                    self._serve(lambda: {"ok": True, "open_trajectories": len(proxy.open_trajectories())})
                else:
                    self._serve(self._not_found)

            def do_POST(self):
                path = self.path.split("?", 1)[0]
                header = self.headers.get(TRAJECTORY_HEADER)
                if path == "/v1/chat/completions":
                    self._serve(lambda: proxy.handle_chat(self._body(), header))
                elif path == "/v1/completions":
                    self._serve(lambda: proxy.handle_completion(self._body(), header))
                else:
                    self._serve(self._not_found)  # its body is discarded (or the connection closed) by reply

            def _not_found(self):
                raise OpenAIError(f"unknown route {self.command} {self.path[:200]}", status=404, code="not_found")

        return Handler
