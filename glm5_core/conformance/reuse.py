"""Reusing a simulated check's result across backends that would compute it identically.

Under ``--simulate`` every backend's kernels run on this host's CPU tensors (the Triton kernels under the
interpreter), so two backends whose run of a check is made of the same facts compute the same result: six vendors
need not multiply the interpreted run. The facts (:func:`run_key`) are the check (family, name: its shapes and
dtypes), where the backend's tensors live, its kernels (each op's implementation and why the reference runs, the
backend's own name taken out), its effective launch configurations (every kernel module's, compiler knobs and the
shared-memory budget included), its dtype set, strict mode, the host (torch, triton, Python, machine,
``TRITON_INTERPRET``) and a hash of glm5_core's sources. A result is reused only under an equal key (never across
differing configurations), and says so in its detail (``reused: ...``, naming the backend that computed it).

The cache is one JSON file per key in a folder (``GLM5_CONFORMANCE_CACHE``, default
``$XDG_CACHE_HOME/glm5_core/conformance-simulated``, else ``~/.cache/...``). Files from disk are untrusted: a file
that is not exactly a stored result of its key is ignored (the check runs). Only passes and reference fallbacks are
stored: a failure (or an error, or a check that could not run) runs again on each backend, its detail its own.
Real devices never reuse: their results are the device's.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform as py_platform
import re
import tempfile
from pathlib import Path
from typing import Any, Optional

import glm5_core
from glm5_core import registry
from glm5_core.conformance.check import Check, Result

STORED = ("pass", "fallback")  # what is reused; a failure runs again on every backend, its detail its own
FORMAT = 1


def cache_dir() -> Path:
    """Where the results are kept (see the module docstring)."""
    if os.environ.get("GLM5_CONFORMANCE_CACHE"):
        return Path(os.environ["GLM5_CONFORMANCE_CACHE"])
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "glm5_core" / "conformance-simulated"


@functools.cache
def source_hash() -> str:
    """sha256 of every ``.py`` file of the glm5_core package (path and bytes, in sorted order)."""
    root = Path(glm5_core.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def launch_facts(backend: str) -> str:
    """The backend's effective launch configurations (every Triton kernel module's, with the shared-memory budget),
    or ``none`` for a backend without a Triton launch table (``<its folder>/launch.py``)."""
    from glm5_core.backends.triton.launch import KernelConfigs

    module_name = f"{registry.BUILTIN_PACKAGE}.{backend}.launch"
    if importlib.util.find_spec(module_name) is None:
        return "none"
    tables = [v for v in vars(importlib.import_module(module_name)).values() if isinstance(v, KernelConfigs)]
    if len(tables) != 1:
        return f"unknown ({len(tables)} launch tables in {module_name})"  # never equal to another backend's
    from glm5_core.backends.triton.table import launches

    def config(c) -> list:
        return [c.num_warps, c.num_stages, sorted(c.blocks.items()), sorted((k, repr(v)) for k, v in c.extra.items())]

    return json.dumps({"shared_memory_limit": tables[0].shared_memory_limit,
                       "launches": {f: config(c) for f, c in sorted(launches(tables[0]).items())}}, sort_keys=True)


NAME = "<backend>"  # a backend's own name, taken out of what it reports


def anonymous(text: str, backend: str) -> str:
    """``text`` with ``backend``'s name (a whole word, or its custom-op namespace ``glm5_<name>``) as ``<backend>``."""
    return re.sub(rf"(?<![\w-]){re.escape(backend)}(?![\w-])|(?<=glm5_){re.escape(backend)}(?=\.)", NAME, text)


def kernel_facts(backend: str) -> list:
    """Each op's implementation on ``backend`` and why the reference runs, the backend's own name taken out (its
    label prefix, its custom-op namespace, the reasons naming it), so two vendors serving the same kernels compare
    equal."""
    return [[r.op, anonymous(r.label, backend), anonymous(r.reason, backend)] for r in registry.explain(backend)]


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def run_key(backend: str) -> dict[str, Any]:
    """The facts of ``backend``'s run that are the same for all its checks (see the module docstring)."""
    be = registry.get_backend(backend)
    return {
        "format": FORMAT,
        "device": be.device(),  # where its tensors live: ``cpu`` on every simulated device
        "source": source_hash(),
        "kernels": kernel_facts(backend),
        "launch": launch_facts(backend),
        "dtypes": sorted(str(d) for d in be.facts.dtypes),
        "strict": registry.strict_mode(),
        # the installed distributions: a simulated stack reports its vendor's build string as torch.__version__
        "host": [_installed("torch"), _installed("triton"), py_platform.python_version(), py_platform.machine(),
                 os.environ.get("TRITON_INTERPRET", "")],
    }


def check_key(run: dict[str, Any], check: Check) -> str:
    """The file name of ``check``'s result under ``run`` (a digest of both)."""
    text = json.dumps({"run": run, "family": check.family, "check": check.name}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _valid(stored: Any, key: str, check: Check) -> Optional[dict]:
    """The stored result if ``stored`` is exactly one (right key, check, field types), else None."""
    if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("backend"), str):
        return None
    r = stored.get("result")
    if not isinstance(r, dict) or set(r) != {f.name for f in dataclasses.fields(Result)}:
        return None
    if r["family"] != check.family or r["check"] != check.name or r["ops"] != list(check.ops):
        return None
    if r["status"] not in STORED or not isinstance(r["detail"], str):
        return None
    for name in ("max_error", "allowed"):
        if r[name] is not None and not (isinstance(r[name], (int, float)) and not isinstance(r[name], bool)):
            return None
    if not isinstance(r["seconds"], (int, float)) or not math.isfinite(r["seconds"]):
        return None
    return stored


class ResultCache:
    """Stored results of one backend's simulated run (``folder``: :func:`cache_dir` unless given)."""

    def __init__(self, backend: str, folder: Optional[Path] = None):
        self.backend = backend
        self.folder = Path(folder) if folder is not None else cache_dir()
        self.run = run_key(backend)
        self.reused = 0

    def get(self, check: Check) -> Optional[Result]:
        """The stored result of ``check`` under this run's key (its detail saying it was reused), else None."""
        key = check_key(self.run, check)
        try:
            stored = _valid(json.loads((self.folder / f"{key}.json").read_text()), key, check)
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if stored is None:
            return None
        r = stored["result"]
        r = {**r, "detail": r["detail"].replace(NAME, self.backend)}  # stored anonymous: this backend's name
        self.reused += 1
        note = (f"reused: computed by {stored['backend']}'s simulated run under an identical key (check, kernels, "
                f"launch configurations, dtype set, host, source {self.run['source'][:12]}; {r['seconds']:.1f} s "
                f"then)")
        return Result(r["family"], r["check"], list(r["ops"]), r["status"], r["max_error"], r["allowed"],
                      f"{r['detail']} ({note})" if r["detail"] else note, 0.0)

    def put(self, check: Check, result: Result) -> None:
        """Store ``result`` (a pass or a reference fallback) for the backends whose run has this key."""
        if result.status not in STORED:
            return
        key = check_key(self.run, check)
        stored = dataclasses.asdict(result)
        stored["detail"] = anonymous(stored["detail"], self.backend)
        payload = {"key": key, "backend": self.backend, "run": self.run, "result": stored}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f)
            os.replace(tmp, self.folder / f"{key}.json")
        except OSError:
            pass  # an unwritable cache costs the next backend a run, nothing else
