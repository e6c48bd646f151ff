"""Cached, import-safe probes of what every vendor shares: Triton (compiler and interpreter).

Nothing in this module runs at ``import glm5_core`` time. Each probe runs on first use and is cached
for the life of the process, so no device runtime is initialised twice; ``triton`` is imported only inside
the probe. Each vendor's own device probe lives in its folder (``glm5_core/backends/<vendor>/device.py``).

Every probe returns ``(available: bool, reason: str)``; the reason is shown to users verbatim.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Callable

Probe = tuple[bool, str]


def triton_interpreter_enabled() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through Triton's interpreter.

    Read the way Triton reads it (1, true, on, yes, y in any case; anything else is off), so that
    ``TRITON_INTERPRET=false`` means the same thing to both."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


@functools.cache
def triton_probe() -> Probe:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'triton>=3.0', or a Triton vendor's extra of glm5-core)"
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # a broken install must not break `import glm5_core`
        return False, f"triton failed to import: {exc!r}"
    return True, f"triton {getattr(triton, '__version__', '?')}"


def triton_interpreter_too_late() -> str:
    """Why Triton's interpreter cannot run kernels in this process ('' when it can).

    Triton decorates its own ``triton.language`` helpers when triton is imported: if that happened
    before ``TRITON_INTERPRET=1`` was set, interpreted kernels fail on the first helper they call."""
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(getattr(standard, "zeros", None)).__name__ == "JITFunction":
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before Python starts"
    return ""


def triton_backend_probe(device_probe: Callable[[], Probe]) -> Probe:
    """Availability of a Triton backend: its vendor's device (``device_probe``, the vendor folder's cached
    probe) and triton, or the interpreter on CPU tensors when ``TRITON_INTERPRET=1``."""
    ok, why = triton_probe()
    if triton_interpreter_enabled():
        if not ok:
            return False, f"TRITON_INTERPRET=1 but {why}"
        late = triton_interpreter_too_late()
        if late:
            return False, late
        return True, f"Triton interpreter on CPU tensors (TRITON_INTERPRET=1), {why}"
    device_ok, device_why = device_probe()
    if not device_ok:
        return False, device_why
    if not ok:
        return False, why
    return True, f"{device_why}, {why}"


def triton_runtime_device(device_type: str) -> str:
    """Where a Triton backend's tensors live: ``cpu`` under the interpreter, else its vendor's ``device_type``."""
    return "cpu" if triton_interpreter_enabled() else device_type
