"""Declarative configs: typed dataclasses whose fields carry their own checks, one line per problem.

The one schema of the model (``GLM5Config``), pretraining (``TrainConfig``) and RL (``RLConfig``) configs.
A field may carry ``metadata`` (see :func:`field`):
  ``range``:   (lo, hi) inclusive bounds, either may be None; ``open``: which bounds are exclusive ("lo", "hi")
  ``choices``: the allowed values
  ``check``:   ``check(value, key)`` raising ValueError / TypeError for a rule of its own (a path that must
               exist, a temperature the trainer can reproduce); its message is the problem
A dataclass may list keys that moved elsewhere in a ``MOVED_KEYS`` ClassVar (key -> where the setting lives
now): such a key gets that explanation instead of "unknown key".
Field types understood: bool, int, float, str, Optional[T], Tuple[T, ...] / Tuple[T, T], List[T], nested
dataclasses, and Dict[str, Any] / Any (kept as they are: their owner validates them).

Two ways in: :func:`build` makes a dataclass from parsed YAML (a list becomes a tuple where a tuple is declared,
an int a float, and ``5e-3``, which YAML 1.1 reads as a string, a number); :func:`check` checks an instance
that already exists, converting nothing. Every problem names its full key (``rollout.max_len: expected an
integer in [2, inf), got '1e9'``); type mismatches are :class:`TypeProblem` so that callers raising
one error can raise TypeError for them.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")
SHOWN_CHARS = 80  # a value quoted in a problem is cut to this many characters (a config is untrusted input)
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")  # 5e-3: a float YAML 1.1 reads as a string


class ConfigError(ValueError):
    """Every problem of a config (``key.path: expected ..., got ...``), reported on one line."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        body = self.problems[0] if len(self.problems) == 1 else \
            f"{len(self.problems)} problems: " + " | ".join(self.problems)
        super().__init__(f"{source}: {body}")


class TypeProblem(str):
    """A problem with the type of a value (not with the value itself)."""


def did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_key(path: str, key: str, options) -> str:
    return f"{path}{key}: unknown key{did_you_mean(key, options)} (known: {', '.join(sorted(options))})"


def shown(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more than sys.get_int_max_str_digits() digits
        text = f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


# ------------------------------------------------------------------------------------------- declaring


def field(default: Any = dataclasses.MISSING, *, factory=dataclasses.MISSING, **metadata) -> Any:
    """A dataclass field with validation metadata (``range``, ``open``, ``choices``, ``check``)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def positive(**extra) -> dict[str, Any]:
    """``metadata`` for a value > 0."""
    return dict(range=(0, None), open=("lo",), **extra)


def non_negative(**extra) -> dict[str, Any]:
    return dict(range=(0, None), **extra)


# ------------------------------------------------------------------------------------------- ranges


def _bounds(meta, integer: bool):
    """(lo, hi, lo_open, hi_open); an integer's open bounds become the closed ones next to them."""
    lo, hi = meta.get("range", (None, None))
    lo_open, hi_open = "lo" in meta.get("open", ()), "hi" in meta.get("open", ())
    if integer and lo is not None and lo_open:
        lo, lo_open = math.floor(lo) + 1, False
    if integer and hi is not None and hi_open:
        hi, hi_open = math.ceil(hi) - 1, False
    return lo, hi, lo_open, hi_open


def _range_text(meta, integer: bool) -> str:
    if "range" not in meta:
        return ""
    lo, hi, lo_open, hi_open = _bounds(meta, integer)
    number = (lambda v: str(v)) if integer else (lambda v: f"{v:g}")
    return (f" in {'(' if lo_open or lo is None else '['}{'-inf' if lo is None else number(lo)}, "
            f"{'inf' if hi is None else number(hi)}{')' if hi_open or hi is None else ']'}")


def _in_range(value, meta, integer: bool) -> bool:
    if "range" not in meta:
        return True
    lo, hi, lo_open, hi_open = _bounds(meta, integer)
    return not ((lo is not None and (value <= lo if lo_open else value < lo)) or
                (hi is not None and (value >= hi if hi_open else value > hi)))


# ------------------------------------------------------------------------------------------- one value


def convert_value(path: str, value: Any, tp, problems: list[str]) -> Any:
    """One parsed-YAML value of type ``tp`` (no field metadata), converted as :func:`build` converts fields."""
    return _value(path, value, tp, {}, problems, convert=True)


def _value(path: str, value: Any, tp, meta, problems: list[str], convert: bool) -> Any:
    """``value`` checked against type ``tp`` and ``meta`` (converted when ``convert``); problems appended."""
    before = len(problems)
    value = _typed(path, value, tp, meta, problems, convert)
    if len(problems) == before and value is not None:
        _constraints(path, value, tp, meta, problems)
    return value


def _mismatch(problems: list[str], path: str, what: str, value: Any) -> None:
    problems.append(TypeProblem(f"{path}: expected {what}, got {shown(value)}"))


def _typed(path: str, value: Any, tp, meta, problems: list[str], convert: bool) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _typed(path, value, inner[0], meta, problems, convert)
    if dataclasses.is_dataclass(tp):
        if convert and isinstance(value, dict):
            return build(tp, value, f"{path}.", problems)
        if not convert and isinstance(value, tp):
            problems.extend(check(value, f"{path}."))
            return value
        _mismatch(problems, path, "a mapping", value)
        return None
    if origin in (list, tuple):
        return _sequence(path, value, origin, args, problems, convert)
    if origin is dict or tp is Any:
        if tp is not Any and not isinstance(value, dict):
            _mismatch(problems, path, "a mapping", value)
            return None
        return value
    if "choices" in meta and not isinstance(value, tp):
        _mismatch(problems, path, f"one of {', '.join(repr(c) for c in meta['choices'])}", value)
        return None
    if tp is bool:
        if not isinstance(value, bool):
            _mismatch(problems, path, "true or false", value)
        return value
    if tp is float:
        if convert and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _mismatch(problems, path, f"a finite number{_range_text(meta, False)}", value)
            return None
        # a number, but not a usable one (inf, nan, an int float() cannot hold): a value problem, not a type problem
        if (isinstance(value, int) and abs(value) > 1e308) or not math.isfinite(value):
            problems.append(f"{path}: expected a finite number{_range_text(meta, False)}, got {shown(value)}")
            return None
        return float(value) if convert else value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _mismatch(problems, path, f"an integer{_range_text(meta, True)}", value)
            return None
        return value
    if tp is str:
        if not isinstance(value, str):
            _mismatch(problems, path, "a string", value)
        return value
    raise AssertionError(f"config_schema: unsupported field type {tp!r} at {path}")


def _sequence(path: str, value: Any, origin, args, problems: list[str], convert: bool) -> Any:
    if not isinstance(value, (list, tuple)):
        _mismatch(problems, path, "a list", value)
        return None
    if origin is tuple and args and args[-1] is not Ellipsis and len(value) != len(args):
        problems.append(f"{path}: expected a list of {len(args)} values, got {len(value)}: {shown(value)}")
        return None
    item_types = [args[0]] * len(value) if origin is list or args[-1] is Ellipsis else list(args)
    items = [_value(f"{path}[{i}]", v, t, {}, problems, convert) for i, (v, t) in enumerate(zip(value, item_types))]
    if not convert:
        return value
    return items if origin is list else tuple(items)


def _constraints(path: str, value: Any, tp, meta, problems: list[str]) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        problems.append(f"{path}: expected one of {', '.join(repr(c) for c in choices)}, got {shown(value)}"
                        + (did_you_mean(value, choices) if isinstance(value, str) else ""))
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        integer = _base_type(tp) is int
        if not _in_range(value, meta, integer):
            what = "an integer" if integer else "a number"
            problems.append(f"{path}: expected {what}{_range_text(meta, integer)}, got {shown(value)}")
            return
    rule = meta.get("check")
    if rule is not None:
        try:
            rule(value, path)
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))


def _base_type(tp):
    if typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


# ------------------------------------------------------------------------------------------- dataclasses


def convert_fields(cls: type, data: dict[str, Any], prefix: str, problems: list[str], *,
                   also_known: Iterable[str] = (), exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The values of ``data`` for fields of ``cls``, converted and checked; keys in ``also_known`` are skipped
    (their owner reads them), any other key that is not a field (or is in ``exclude``) is an unknown key."""
    hints = typing.get_type_hints(cls)
    excluded = set(exclude)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in excluded}
    also_known = set(also_known)
    moved = getattr(cls, "MOVED_KEYS", {})  # ClassVar: key -> where its setting lives now
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in also_known:
            continue
        if key in moved:
            problems.append(f"{prefix}{key}: {moved[key]}; remove {prefix}{key}={shown(value)}")
            continue
        if key not in fields:
            problems.append(unknown_key(prefix, str(key), set(fields) | also_known))
            continue
        before = len(problems)
        converted = _value(f"{prefix}{key}", value, hints[key], fields[key].metadata, problems, convert=True)
        if len(problems) == before:
            out[key] = converted
    return out


def build(cls: type[T], data: dict[str, Any], prefix: str, problems: list[str]) -> T:
    """Build dataclass ``cls`` from parsed YAML ``data``; append problems (with ``prefix`` as key path)."""
    return cls(**convert_fields(cls, data, prefix, problems))


def check(obj: Any, prefix: str = "", *, exclude: Iterable[str] = ()) -> list[str]:
    """The problems of an existing dataclass instance, in field order; nothing is converted."""
    hints = typing.get_type_hints(type(obj))
    problems: list[str] = []
    for f in dataclasses.fields(obj):
        if f.name not in exclude:
            _value(f"{prefix}{f.name}", getattr(obj, f.name), hints[f.name], f.metadata, problems, convert=False)
    return problems


def as_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for logging the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: as_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [as_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: as_plain(v) for k, v in obj.items()}
    return obj
