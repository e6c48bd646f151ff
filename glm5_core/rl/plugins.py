"""Plug-ins by import path: ``"pkg.module:attribute"`` names an object a run builds on (an environment
factory, a reward function, a loss, an advantage estimator).

A setting is either a built-in name or an import path; anything else is a ``ValueError`` naming the key,
the built-in choices and what came, never a silent default. Importing runs the module's code: a config
names modules the way a command line names a script, so only trusted configs should name plug-ins.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any, Callable

from glm5_core.config_schema import did_you_mean, shown

_IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def is_import_path(value: Any) -> bool:
    return isinstance(value, str) and ":" in value


def load_object(path: Any, key: str) -> Any:
    """The object ``"pkg.module:name"`` (``name`` may be dotted: ``Class.method``) names; ValueError naming
    ``key`` if the path is malformed, the module does not import or has no such attribute."""
    if not isinstance(path, str) or not _IMPORT_PATH.fullmatch(path):
        raise ValueError(f"{key}: expected an import path 'pkg.module:name', got {shown(path)}")
    module_name, attribute = path.split(":", 1)
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key}: cannot import module {module_name!r} of {path!r} ({type(exc).__name__}: "
                         f"{exc})") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} has no attribute {attribute!r} (import path {path!r})")
        obj = getattr(obj, part)
    return obj


def resolve_callable(value: Any, builtins: Mapping[str, Callable], key: str) -> Callable:
    """The built-in called ``value``, or the callable at import path ``value``."""
    if is_import_path(value):
        obj = load_object(value, key)
        if not callable(obj):
            raise ValueError(f"{key}: {value!r} names a {type(obj).__name__}, expected a callable")
        return obj
    if isinstance(value, str) and value in builtins:
        return builtins[value]
    hint = did_you_mean(value, builtins) if isinstance(value, str) else ""
    raise ValueError(f"{key}: expected one of {', '.join(repr(n) for n in builtins)} or an import path "
                     f"'pkg.module:name', got {shown(value)}{hint}")
