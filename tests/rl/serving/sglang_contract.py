"""SGLang 0.5.23's JSON contract for ``/generate`` answers, as its clients read them: the rules of
``sglang/api/v1/api_types.py`` (``decode_GenerateResponse``, ``decode_GenerateMetaInfo``, ``decode_FinishReason``,
``decode_LogprobEntry``, ``decode_WeightVersionSpan``; generated from ``proto/sglang/api/v1``), rewritten here
without msgspec and with none of glm5-core's code, so a test can hold ``glm5 serve``'s answers to them.
Unknown keys are ignored, as there; a violation raises :class:`ContractError` with serde's wording.
"""


class ContractError(ValueError):
    pass


def _unexpected(v):
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


def _check(ok, v, expected):
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")
    return v


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _uint(v, expected):
    _check(_is_int(v), v, expected)
    if v < 0:
        raise ContractError(f"invalid value: integer `{v}`, expected {expected}")
    return v


def _str(v):
    return _check(isinstance(v, str), v, "a string")


def _seq(v, expected="a sequence"):
    return _check(isinstance(v, list), v, expected)


def _map(v, expected):
    return _check(isinstance(v, dict), v, expected)


def token_ids(v):
    return [_check(_is_int(e), e, "i64") for e in _seq(v)]


def logprob_entry(v):
    s = _seq(v, "a 3-element tuple")
    if len(s) != 3:
        raise ContractError(f"invalid length {len(s)}, expected a 3-element tuple")
    if s[0] is not None:
        _check(isinstance(s[0], (int, float)) and not isinstance(s[0], bool), s[0], "f64")
    _check(_is_int(s[1]), s[1], "i64")
    if s[2] is not None:
        _str(s[2])


def finish_reason(v):
    """``decode_FinishReason``: a map; a tagged variant whose fields do not decode is kept as a raw map."""
    _map(v, "map")


def weight_version_span(v):
    m = _map(v, "struct WeightVersionSpan")
    if "version" in m:
        _str(m["version"])
    for key in ("start", "end"):
        if key in m:
            _check(_is_int(m[key]), m[key], "i64")


def meta_info(v):
    m = _map(v, "struct GenerateMetaInfo")
    for key, x in m.items():
        if key == "id":
            _str(x)
        elif key in ("prompt_tokens", "cached_tokens"):
            _uint(x, "u32")
        elif key in ("completion_tokens", "reasoning_tokens"):
            _uint(x, "u64")
        elif key == "finish_reason" and x is not None:
            finish_reason(x)
        elif key in ("output_token_logprobs", "input_token_logprobs") and x is not None:
            for e in _seq(x):
                logprob_entry(e)
        elif key == "weight_version" and x is not None:
            _str(x)
        elif key == "weight_versions" and x is not None:
            for e in _seq(x):
                weight_version_span(e)
        elif key == "e2e_latency" and x is not None:
            _check(isinstance(x, (int, float)) and not isinstance(x, bool), x, "f64")


def generate_response(v):
    """``decode_GenerateResponse`` (``text``, when present, must be a string: ``null`` is refused)."""
    m = _map(v, "struct GenerateResponse")
    for key, x in m.items():
        if key == "text":
            _str(x)
        elif key == "meta_info" and x is not None:
            meta_info(x)
        elif key in ("output_ids", "prompt_token_ids") and x is not None:
            token_ids(x)
        elif key == "index" and x is not None:
            _uint(x, "u32")
