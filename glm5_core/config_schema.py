"""Typed dataclasses from parsed YAML, with every problem reported as one line naming its key path.

A field may carry ``metadata``:
  ``range``:   (lo, hi) inclusive bounds, either may be None; ``open``: which bounds are exclusive ("lo", "hi")
  ``choices``: the allowed values
Field types understood: bool, int, float, str, Optional[T], Tuple[T, ...] / Tuple[T, T], List[T], nested
dataclasses, and Dict[str, Any] (kept as is: its owner validates it).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Dict, List, Type, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """All problems of a config, one per line (``key.path: expected ..., got ...``)."""

    def __init__(self, problems: List[str], source: str = "config"):
        self.problems = list(problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s)\n  " + "\n  ".join(self.problems))


def did_you_mean(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_key(path: str, key: str, options) -> str:
    return f"{path}{key}: unknown key{did_you_mean(key, options)} (known: {', '.join(sorted(options))})"


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _convert(path: str, value: Any, tp, problems: List[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(path, value, inner[0], problems)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return tp()
        return build(tp, value, f"{path}.", problems)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return None
        if origin is tuple and args and args[-1] is not Ellipsis and len(value) != len(args):
            problems.append(f"{path}: expected a list of {len(args)} values, got {len(value)}: {value!r}")
            return None
        item_types = [args[0]] * len(value) if origin is list or args[-1] is Ellipsis else list(args)
        items = [_convert(f"{path}[{i}]", v, t, problems) for i, (v, t) in enumerate(zip(value, item_types))]
        return items if origin is list else tuple(items)
    if origin is dict or tp is Any:
        if tp is not Any and not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return {}
        return value
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "5e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{path}: expected a finite number, got {value!r}")
            return value
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise AssertionError(f"schema: unsupported field type {tp!r} at {path}")


def _check_constraints(path: str, value: Any, meta, problems: List[str]) -> None:
    if value is None or isinstance(value, bool):
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        problems.append(f"{path}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}"
                        + (did_you_mean(value, choices) if isinstance(value, str) else ""))
    bounds = meta.get("range")
    if bounds is not None and isinstance(value, (int, float)):
        lo, hi = bounds
        lo_open, hi_open = "lo" in meta.get("open", ()), "hi" in meta.get("open", ())
        bad = (lo is not None and (value <= lo if lo_open else value < lo)) or \
              (hi is not None and (value >= hi if hi_open else value > hi))
        if bad:
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            lo_s = "-inf" if lo is None else f"{lo:g}"
            hi_s = "inf" if hi is None else f"{hi:g}"
            problems.append(f"{path}: expected a value in {left}{lo_s}, {hi_s}{right}, got {value!r}")


def build(cls: Type[T], data: Dict[str, Any], prefix: str, problems: List[str]) -> T:
    """Build dataclass ``cls`` from ``data``; append problems (with ``prefix`` as key path) to ``problems``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: Dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            problems.append(unknown_key(prefix, str(key), fields))
            continue
        path = f"{prefix}{key}"
        before = len(problems)
        converted = _convert(path, value, hints[key], problems)
        if len(problems) == before:
            _check_constraints(path, converted, fields[key].metadata, problems)
        if len(problems) == before:
            kwargs[key] = converted
    return cls(**kwargs)


def positive(**extra) -> Dict[str, Any]:
    """``metadata`` for a value > 0."""
    return dict(range=(0, None), open=("lo",), **extra)


def non_negative(**extra) -> Dict[str, Any]:
    return dict(range=(0, None), **extra)


def field(default: Any = dataclasses.MISSING, *, factory=dataclasses.MISSING, **metadata) -> Any:
    """A dataclass field with validation metadata (``range``, ``open``, ``choices``)."""
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def as_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for logging the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: as_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [as_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: as_plain(v) for k, v in obj.items()}
    return obj

