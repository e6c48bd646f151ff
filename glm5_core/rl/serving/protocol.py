"""SGLang-compatible ``/generate`` requests and responses, as SGLang 0.5.23 defines them
(``sglang/srt/managers/io_struct.py`` ``GenerateReqInput``; the JSON contract ``sglang/api/v1/api_types.py``
``GenerateRequest`` / ``SamplingParams`` / ``GenerateResponse``, which the HTTP server checks every body against).

Request (JSON): ``{"input_ids": [int] | [[int], ...], "sampling_params": {...} | [{...}, ...],
"return_logprob": bool | [bool], "rid": str | [str], "return_routed_experts", "return_indexer_topk",
"return_prompt_token_ids", ...}``. A list of token lists is a batch: the answer is a list of responses in the
same order, each request sampled as if sent alone. Sampling parameters: ``temperature``, ``top_p``,
``max_new_tokens`` (SGLang's default 128, capped by the engine), ``stop_token_ids``, ``sampling_seed`` (the field of
that name of SGLang's ``SamplingParams``: a random stream of the request's own, so what it samples does not depend
on which requests shared its batches; with speculative decoding on it fixes the first token only).

As SGLang's contract does: unknown top-level keys are ignored (``GenerateRequest``: "unknown keys ignored") and
unknown sampling keys are refused (``SamplingParams``: "unknown keys rejected"). Fields this engine cannot honour
(``text``, ``stream``, media, LoRA, top logprobs, hidden states, ...) are accepted at their neutral value and refused
otherwise (``NEUTRAL_FIELDS``, ``NEUTRAL_PARAMS``), so no request is silently served differently; SGLang clients'
default sampling values (``top_k: -1``, ``skip_special_tokens``, ...) are neutral.

Response, as SGLang's tokenizer manager builds it for a token-in-token-out server (``skip_tokenizer_init``: no
``text`` key, which the contract requires to be a string when present):
``{"output_ids": [int], "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
"output_token_logprobs": [[logprob, token_id, null]], "finish_reason": {"type": "stop", "matched": id} |
{"type": "length", "length": n} | {"type": "abort", "message": str, ...}, "weight_version": str,
"weight_versions": [{"version": str, "start": int, "end": int}]}}`` (+ ``"prompt_token_ids"`` when asked).
``weight_versions`` are SGLang's spans of output tokens sampled under one weight version (several when an update
landed mid-generation); ``weight_version`` is the last span's version, a string (``"default"`` before any update).
With ``"return_routed_experts": true`` / ``"return_indexer_topk": true`` (an engine started with
``record_routing`` / ``record_index_topk``), ``meta_info.routed_experts`` / ``meta_info.indexer_topk`` carry the
replay traces of every position but the last in SGLang's wire form (``replay_trace``).

Requests come from the network, so :func:`parse_generate_batch` checks everything: types, token ids in
``[0, vocab_size)``, lengths capped, sampling parameters in range. Failures are ``ValueError`` naming the field.
"""
from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any, Callable, Optional

from glm5_core.rl.serving import replay_trace

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


@dataclasses.dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_input_tokens: int
    max_new_tokens: int
    max_stop_tokens: int = 16


@dataclasses.dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    return_logprob: bool = True
    sampling_seed: Optional[int] = None  # None: the engine's shared generator
    return_routed_experts: bool = False  # SGLang's request field: the experts of every position (routing replay)
    return_indexer_topk: bool = False  # the DSA keys of every position (index replay)
    return_prompt_token_ids: bool = False  # SGLang's field: the response repeats the prompt's ids


MAX_SAMPLING_SEED = 2 ** 63  # torch.Generator.manual_seed takes any int below this


def _sampling_seed(params: dict) -> Optional[int]:
    seed = params.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SAMPLING_SEED):
        raise ValueError(f"sampling_params.sampling_seed: expected null or an int in [0, 2**63), got {seed!r:.80}")
    return seed


def _int_list(name: str, value: Any, *, vocab_size: int, max_len: int, min_len: int) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{name}: expected a list of token ids, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise ValueError(f"{name}: expected between {min_len} and {max_len} token ids, got {len(value)}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{i}]: expected a token id in [0, {vocab_size}), got {t!r}")
    return list(value)


def _number(params: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = params.get(name, default)
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an int beyond float range, e.g. 10**400
        finite = False
    if not finite:
        raise ValueError(f"sampling_params.{name}: expected a finite number, got {value!r:.80}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise ValueError(f"sampling_params.{name}: expected a value in {bracket}{lo}, {hi}], got {value!r}")
    return float(value)


# SGLang sampling parameters that SGLang clients (slime among them) send by default: accepted when they ask for
# nothing (the value that turns the feature off), refused otherwise, so no request is silently served differently.
# Detokenisation options are accepted as any bool: this engine is token-in-token-out and returns no text.
# The engine knows no EOS token (it stops on ``stop_token_ids`` only), so ``ignore_eos`` must be true, or false
# with explicit ``stop_token_ids`` (the client names its EOS there).
NEUTRAL_PARAMS: dict[str, tuple[Any, ...]] = {
    "top_k": (-1, 0, 1 << 30), "min_p": (0, 0.0), "min_new_tokens": (0,), "n": (1,),
    "repetition_penalty": (1, 1.0), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "ignore_eos": (True,), "stop": (None, [], ""),
    "skip_special_tokens": (True, False), "spaces_between_special_tokens": (True, False), "no_stop_trim": (True, False),
    # the rest of SGLang 0.5.23's SamplingParams (api/v1/api_types.py), each at its default
    "stop_regex": (None, [], ""), "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "custom_params": (None,), "beam_width": (None,), "watermark": (None,),
    "choice": (None, []), "stream_interval": (None,),
}

# GenerateReqInput fields (sglang/srt/managers/io_struct.py, 0.5.23) that ask for something this engine does not
# do: accepted at their neutral value, refused otherwise. The others (priority, routing_key, extra_key,
# custom_labels, log_metrics, ...) change nothing this engine computes, and unknown keys are ignored, as SGLang does.
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "text": (None,), "input_embeds": (None,), "image_data": (None,), "video_data": (None,), "audio_data": (None,),
    "mm_hashes": (None,), "stream": (False, None), "logprob_start_len": (None, -1), "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,), "return_hidden_states": (None, False), "return_text_in_logprobs": (None, False),
    "return_sampling_mask": (None, False), "lora_path": (None,), "lora_id": (None,), "session_params": (None,),
    "session_id": (None,), "custom_logit_processor": (None,), "routed_experts_start_len": (0, None),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,), "bootstrap_pair_key": (None,),
    "return_entropy": (False, None), "return_bytes": (False, None), "background": (False, None),
    "max_thinking_tokens": (None,), "input_ids": (),  # input_ids: parsed below
}


def _check_neutral(params: dict) -> None:
    for name, neutral in NEUTRAL_PARAMS.items():
        if name not in params:
            continue
        value = params[name]
        if name == "ignore_eos" and value is False and params.get("stop_token_ids"):
            continue  # the engine knows no EOS token: it stops on stop_token_ids only, which the client gave
        # bools are ints in Python: True must not pass for top_k 1 nor 1 for True
        if not any(type(value) is type(n) and value == n for n in neutral):
            raise ValueError(f"sampling_params.{name}: not supported by this engine except as one of "
                             f"{list(neutral)}, got {value!r:.80}")


def _check_neutral_fields(body: dict) -> None:
    for name, neutral in NEUTRAL_FIELDS.items():
        if name == "input_ids" or name not in body:
            continue
        value = body[name]
        if not any(type(value) is type(n) and value == n for n in neutral) and not (value is None and None in neutral):
            detail = "this engine is token-in-token-out; send input_ids" if name == "text" else \
                f"not supported by this engine except as one of {list(neutral)}"
            raise ValueError(f"{name}: {detail}, got {value!r:.80}")


def _per_request(body: dict, name: str, i: int, n: int, batch: bool) -> Any:
    """Field ``name`` of the ``i``-th of ``n`` requests: a list gives one value per request (batch only)."""
    value = body.get(name)
    if batch and isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name}: expected one entry per request ({n}), got {len(value)}")
        return value[i]
    return value


def _parse_one(body: dict, input_ids: Any, params: Any, return_logprob: Any, rid: Any, limits: Limits,
               where: str) -> GenerateRequest:
    input_ids = _int_list(f"input_ids{where}", input_ids, vocab_size=limits.vocab_size,
                          max_len=limits.max_input_tokens, min_len=1)
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params{where}: expected an object, got {type(params).__name__}")
    unknown = set(params) - {"temperature", "top_p", "max_new_tokens", "stop_token_ids", "sampling_seed"} \
        - set(NEUTRAL_PARAMS)
    if unknown:
        raise ValueError(f"sampling_params{where}: unknown fields {sorted(unknown)}")
    _check_neutral(params)
    temperature = _number(params, "temperature", 1.0, 0.0, 100.0)
    top_p = _number(params, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    max_new = params.get("max_new_tokens")
    max_new = min(128, limits.max_new_tokens) if max_new is None else max_new  # SGLang's default: 128
    if isinstance(max_new, bool) or not isinstance(max_new, int) or not 1 <= max_new <= limits.max_new_tokens:
        raise ValueError(f"sampling_params.max_new_tokens: expected an int in [1, {limits.max_new_tokens}], "
                         f"got {max_new!r}")
    stops = params.get("stop_token_ids")
    stops = _int_list("sampling_params.stop_token_ids", [] if stops is None else stops,
                      vocab_size=limits.vocab_size, max_len=limits.max_stop_tokens, min_len=0)
    return_logprob = False if return_logprob is None else return_logprob
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob{where}: expected a bool, got {return_logprob!r}")
    rid = uuid.uuid4().hex if rid is None else rid
    if not isinstance(rid, str) or not 1 <= len(rid) <= 256:
        raise ValueError(f"rid{where}: expected a str of 1 to 256 characters, got {rid!r:.80}")
    flags = []
    for name in ("return_routed_experts", "return_indexer_topk", "return_prompt_token_ids"):
        flag = body.get(name, False)
        flag = False if flag is None else flag
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected a bool, got {flag!r:.80}")
        flags.append(flag)
    return GenerateRequest(rid, input_ids, temperature, top_p, int(max_new), tuple(stops), return_logprob,
                           _sampling_seed(params), *flags)


MAX_BATCH_REQUESTS = 1024  # requests in one batched /generate body


def parse_generate_batch(body: Any, limits: Limits) -> tuple[list[GenerateRequest], bool]:
    """The requests of one ``/generate`` body and whether it was a batch (``input_ids`` a list of lists: the
    answer is then a list)."""
    if not isinstance(body, dict):
        raise ValueError(f"request: expected a JSON object, got {type(body).__name__}")
    _check_neutral_fields(body)
    input_ids = body.get("input_ids")
    batch = isinstance(input_ids, list) and bool(input_ids) and all(isinstance(x, list) for x in input_ids)
    if not batch:
        request = _parse_one(body, input_ids, body.get("sampling_params"), body.get("return_logprob"),
                             body.get("rid"), limits, "")
        return [request], False
    n = len(input_ids)
    if n > MAX_BATCH_REQUESTS:
        raise ValueError(f"input_ids: expected at most {MAX_BATCH_REQUESTS} requests in a batch, got {n}")
    rids = body.get("rid")
    if rids is not None and not isinstance(rids, list):
        raise ValueError(f"rid: expected a list of {n} ids for a batch of {n} requests, got {rids!r:.80}")
    requests = [_parse_one(body, ids, _per_request(body, "sampling_params", i, n, True),
                           _per_request(body, "return_logprob", i, n, True),
                           _per_request(body, "rid", i, n, True), limits, f"[{i}]")
                for i, ids in enumerate(input_ids)]
    if len({r.rid for r in requests}) != n:
        raise ValueError("rid: expected distinct ids within a batch")
    return requests, True


def parse_generate_request(body: Any, limits: Limits) -> GenerateRequest:
    """One (non-batch) ``/generate`` request."""
    requests, batch = parse_generate_batch(body, limits)
    if batch:
        raise ValueError(f"input_ids: expected one request's token ids, got a batch of {len(requests)}")
    return requests[0]


@dataclasses.dataclass
class GenerateResult:
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    topk_trace: Optional[list[list[list[int]]]] = None  # per sampled token, per full-indexer layer: top-k ids
    # replay traces (see replay_trace), when the request asked: per position [P, M, K] experts, [P, F, Ki] keys
    routed_experts: Optional[Any] = None
    indexer_topk: Optional[Any] = None

    def finish_reason_json(self) -> dict[str, Any]:
        """SGLang's ``BaseFinishReason.to_json()`` forms."""
        if self.finish_reason == FINISH_STOP:
            return {"type": FINISH_STOP, "matched": self.output_ids[-1] if self.output_ids else None}
        if self.finish_reason == FINISH_LENGTH:
            return {"type": FINISH_LENGTH, "length": len(self.output_ids)}
        return {"type": FINISH_ABORT, "message": "Aborted", "status_code": None, "err_type": None}

    def to_json(self, return_logprob: bool = True, label: Callable[[int], str] = str,
                current_version: Optional[int] = None, layout: Optional[replay_trace.TraceLayout] = None,
                prompt_ids: Optional[list[int]] = None) -> dict[str, Any]:
        """``label`` names an engine version as the server reports it; ``current_version`` is the engine's
        version now (the ``weight_version`` of a request that sampled nothing); ``layout`` places the replay
        traces in SGLang's per-layer arrays; ``prompt_ids`` (``return_prompt_token_ids``) are repeated."""
        spans = version_spans(self.versions, label)
        if spans:
            version = spans[-1]["version"]
        else:
            version = label(current_version) if current_version is not None else None
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason_json(),
            "prompt_tokens": self.prompt_tokens,
            "weight_version": version,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_versions": spans,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(self.logprobs, self.output_ids)]
        for key, kind, trace in (("routed_experts", "routing", self.routed_experts),
                                 ("indexer_topk", "index", self.indexer_topk)):
            if trace is not None:
                if layout is None:
                    raise ValueError(f"{key}: a trace needs the model's layer layout to be sent")
                meta[key] = replay_trace.encode(trace, kind, layout)
        out: dict[str, Any] = {"output_ids": list(self.output_ids), "meta_info": meta}  # no "text": token ids only
        if prompt_ids is not None:
            out["prompt_token_ids"] = list(prompt_ids)
        return out


def version_spans(versions: list[int], label: Callable[[int], str] = str) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions``: runs of output tokens sampled under one version, ``[start, end)``."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        name = label(v)
        if spans and spans[-1]["version"] == name:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": name, "start": i, "end": i + 1})
    return spans
