"""OpenAI chat / completions requests and responses, as the ``openai`` package's types define them
(``openai.types.chat.ChatCompletion``, ``openai.types.Completion``, ``openai.types.Model``; read in openai 3.57).

Requests come from the network: :func:`parse_chat_request` / :func:`parse_completion_request` check every field
and raise :class:`OpenAIError` (HTTP 400, OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``)
naming it. Parameters this token-in-token-out proxy cannot honour exactly (``n`` > 1, streaming, penalties, seeds,
top log-prob alternatives, forced tool choice, ...) are refused unless they ask for nothing, and unknown ones are
refused as OpenAI does, so no request is silently served differently.

Messages are turned into the dicts chat templates read: ``{"role", "content"}`` plus ``name``, ``tool_calls``
(``{"id", "type": "function", "function": {"name", "arguments"}}``, ``arguments`` parsed from its JSON string into an
object when it is one, as Hugging Face templates expect) and ``tool_call_id``. Text content parts are joined; an
assistant's empty content is ``None``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any, Optional, Union

MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP = 4  # OpenAI's limit
MAX_ID_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


# ----------------------------------------------------------------------------------------------------- fields
def _fail(param: str, expected: str, value: Any) -> OpenAIError:
    return OpenAIError(f"{param}: expected {expected}, got {value!r:.80}", param=param)


def _str(body: dict, name: str, *, required: bool = False, max_chars: Optional[int] = None,
         where: str = "") -> Optional[str]:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value) or (max_chars and len(value) > max_chars):
        limit = f" of at most {max_chars} characters" if max_chars else ""
        raise _fail(f"{where}.{name}" if where else name, f"a {'non-empty ' if required else ''}string{limit}", value)
    return value


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        ok = False
    if not ok or value < lo or value > hi or (lo_open and value == lo):
        raise _fail(name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return float(value)


def _count(body: dict, name: str, lo: int = 1) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _fail(name, f"an int >= {lo}", value)
    return value


def _neutral(body: dict, name: str, *neutral: Any) -> None:
    """``name`` may be absent or one of the values that ask for nothing."""
    if name not in body or body[name] is None:
        return
    value = body[name]
    if not any(type(value) is type(n) and value == n for n in neutral):
        allowed = f"except as one of {list(neutral)}" if neutral else "(expected null or absent)"
        raise OpenAIError(f"{name}: not supported by this server {allowed}, got {value!r:.80}", param=name)


def _unknown(body: dict, known: frozenset) -> None:
    for name in body:
        if name not in known:
            raise OpenAIError(f"Unrecognized request argument supplied: {name}", param=name)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _fail("stop", f"a string or a list of at most {MAX_STOP} non-empty strings", body.get("stop"))
    return list(stop)


def _max_tokens(body: dict) -> Optional[int]:
    values = {n: _count(body, n) for n in ("max_tokens", "max_completion_tokens") if body.get(n) is not None}
    if len(set(values.values())) > 1:
        raise OpenAIError(f"max_tokens and max_completion_tokens differ: {values}", param="max_completion_tokens")
    return next(iter(values.values()), None)


# ---------------------------------------------------------------------------------------------------- messages
def _content(message: dict, where: str, *, optional: bool) -> Optional[str]:
    content = message.get("content")
    if content is None:
        if optional:
            return None
        raise _fail(f"{where}.content", "a string or a list of text parts", None)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
                    or set(part) - {"type", "text"}:
                raise _fail(f"{where}.content[{j}]", 'a text part {"type": "text", "text": ...} (only text is '
                            "supported)", part)
            texts.append(part["text"])
        return "".join(texts)
    raise _fail(f"{where}.content", "a string or a list of text parts", content)


def _arguments(text: str) -> Union[dict, str]:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _tool_calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise _fail(where, "a list of tool calls", value)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" or set(call) - {"id", "type",
                                                                                                     "function"}:
            raise _fail(at, '{"id", "type": "function", "function": {"name", "arguments"}}', call)
        call_id = _str(call, "id", required=True, max_chars=MAX_ID_CHARS, where=at)
        function = call.get("function")
        if not isinstance(function, dict) or set(function) - {"name", "arguments"}:
            raise _fail(f"{at}.function", '{"name", "arguments"}', function)
        name = _str(function, "name", required=True, max_chars=MAX_ID_CHARS, where=f"{at}.function")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise _fail(f"{at}.function.arguments", "a JSON string", arguments)
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": name, "arguments": _arguments(arguments)}})
    return calls


_MESSAGE_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    # what the openai client's ChatCompletionMessage.model_dump() holds, so an agent can send the message back
    "assistant": {"role", "content", "name", "tool_calls", "refusal", "annotations", "audio", "function_call"},
    "tool": {"role", "content", "tool_call_id"},
}


def parse_message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _fail(where, "an object", message)
    role = message.get("role")
    if role not in ROLES:
        raise _fail(f"{where}.role", f"one of {list(ROLES)}", role)
    extra = set(message) - _MESSAGE_KEYS[role]
    if extra:
        raise OpenAIError(f"{where}: unsupported fields {sorted(extra)} for role {role!r}",
                          param=f"{where}.{min(extra)}")
    out: dict[str, Any] = {"role": role, "content": _content(message, where, optional=role == "assistant")}
    if message.get("name") is not None:
        out["name"] = _str(message, "name", required=True, max_chars=MAX_ID_CHARS, where=where)
    if role == "assistant":
        for name in ("audio", "function_call", "refusal"):
            if message.get(name) is not None:
                raise OpenAIError(f"{where}.{name}: not supported (expected null)", param=f"{where}.{name}")
        if message.get("annotations"):
            raise OpenAIError(f"{where}.annotations: not supported (expected null or [])",
                              param=f"{where}.annotations")
        out["content"] = out["content"] or None
        calls = _tool_calls(message["tool_calls"], f"{where}.tool_calls") if message.get("tool_calls") else []
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = _str(message, "tool_call_id", required=True, max_chars=MAX_ID_CHARS, where=where)
    return out


def _tools(body: dict) -> Optional[list[dict]]:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _fail("tools", f"a list of at most {MAX_TOOLS} function tools", tools)
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"} \
                or not isinstance(function, dict) or set(function) - {"name", "description", "parameters", "strict"} \
                or not isinstance(function.get("name"), str) or not function["name"] \
                or not isinstance(function.get("description", ""), str) \
                or not isinstance(function.get("parameters", {}), dict):
            raise _fail(f"tools[{j}]", '{"type": "function", "function": {"name", "description", "parameters"}}',
                        tool)
    return tools or None


# ---------------------------------------------------------------------------------------------------- requests
@dataclasses.dataclass
class SamplingRequest:
    """What both endpoints share."""

    model: str
    max_tokens: Optional[int]  # None: the server's default
    temperature: Optional[float]  # None: not given
    top_p: Optional[float]
    stop: list[str]
    user: Optional[str]


@dataclasses.dataclass
class ChatRequest(SamplingRequest):
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tools: Optional[list[dict]] = None  # rendered by the template; None when absent or tool_choice is "none"
    logprobs: bool = False


@dataclasses.dataclass
class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int]] = ""
    logprobs: bool = False


_SHARED = frozenset({"model", "max_tokens", "temperature", "top_p", "stop", "user", "n", "stream", "stream_options",
                     "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"})
_CHAT = _SHARED | {"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens", "top_logprobs",
                   "response_format", "metadata", "store", "modalities", "service_tier", "prompt_cache_key",
                   "safety_identifier"}
_COMPLETION = _SHARED | {"prompt", "echo", "suffix", "best_of"}


def _sampling(body: dict) -> dict[str, Any]:
    _neutral(body, "n", 1)
    _neutral(body, "stream", False)
    _neutral(body, "seed")  # the engine draws from its own generator: a seed cannot be honoured
    _neutral(body, "presence_penalty", 0, 0.0)
    _neutral(body, "frequency_penalty", 0, 0.0)
    _neutral(body, "logit_bias", {})
    if body.get("stream_options") is not None:
        raise OpenAIError("stream_options: streaming is not supported", param="stream_options")
    return dict(model=_str(body, "model", required=True, max_chars=MAX_ID_CHARS), max_tokens=_max_tokens(body),
                temperature=_number(body, "temperature", 0.0, 2.0),
                top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True), stop=_stop(body),
                user=_str(body, "user", max_chars=MAX_ID_CHARS))


def _request_fields(body: Any, known) -> dict[str, Any]:
    """The fields chat and completion requests share, from a JSON object with no key outside ``known``."""
    if not isinstance(body, dict):
        raise OpenAIError(f"request body: expected a JSON object, got {type(body).__name__}")
    _unknown(body, known)
    return _sampling(body)


def parse_chat_request(body: Any) -> ChatRequest:
    shared = _request_fields(body, _CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise _fail("messages", f"a list of 1 to {MAX_MESSAGES} messages", type(messages).__name__)
    parsed = [parse_message(m, i) for i, m in enumerate(messages)]
    tools = _tools(body)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise OpenAIError(f"tool_choice: only 'auto' and 'none' are supported (no constrained decoding), "
                          f"got {choice!r:.80}", param="tool_choice")
    _neutral(body, "parallel_tool_calls", True)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _fail("logprobs", "a bool", logprobs)
    _neutral(body, "top_logprobs", 0)  # alternatives are not computed: the engine returns the sampled token's only
    format_ = body.get("response_format")
    if format_ is not None and format_ != {"type": "text"}:
        raise OpenAIError("response_format: only {'type': 'text'} is supported", param="response_format")
    _neutral(body, "store", False)
    _neutral(body, "modalities", ["text"])
    _neutral(body, "service_tier", "auto", "default")
    for name in ("metadata",):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise _fail(name, "an object", body[name])
    for name in ("prompt_cache_key", "safety_identifier"):  # hints for OpenAI's service: nothing to do here
        _str(body, name, max_chars=MAX_ID_CHARS)
    return ChatRequest(**shared, messages=parsed, tools=None if choice == "none" else tools,
                       logprobs=bool(logprobs))


def parse_completion_request(body: Any) -> CompletionRequest:
    shared = _request_fields(body, _COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids_ok = isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids_ok:
        raise _fail("prompt", "a non-empty string or a list of token ids (one prompt: batches are not supported)",
                    body.get("prompt"))
    _neutral(body, "echo", False)
    _neutral(body, "suffix")
    _neutral(body, "best_of", 1)
    _neutral(body, "logprobs", 0)  # 0: the sampled token's log-prob, no alternatives
    return CompletionRequest(**shared, prompt=prompt, logprobs=body.get("logprobs") == 0)


# --------------------------------------------------------------------------------------------------- responses
def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int]) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": int(cached_tokens)}
    return usage


def chat_completion(*, model: str, content: Optional[str], tool_calls: list[dict], finish_reason: str,
                    logprobs: Optional[list[dict]], prompt_tokens: int, completion_tokens: int,
                    cached_tokens: Optional[int] = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
        "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                     "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}],
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def chat_token_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": float(logprob), "top_logprobs": []}


def text_completion(*, model: str, text: str, finish_reason: str, logprobs: Optional[dict[str, Any]],
                    prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> dict[str, Any]:
    return {
        "id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()), "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
        "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
    }


def completion_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    offsets, position = [], 0
    for t in tokens:
        offsets.append(position)
        position += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs], "top_logprobs": None,
            "text_offset": offsets}


def model_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": n, "object": "model", "created": created, "owned_by": "glm5-core"} for n in names]}
