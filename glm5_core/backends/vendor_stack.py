"""Probing a vendor's PyTorch stack, shared by the vendor folders (each passes its own names; nothing here names a
vendor).

Two shapes of stack:

* an **extension module** (``torch_<x>``) that registers its own torch device type (PrivateUse1): found without
  importing it, imported once by the probe, then asked ``torch.<device_type>.is_available()`` (:func:`extension_probe`);
* a torch build that **presents its devices under another vendor's device type**: told apart by the vendor's own
  documented markers only, never by elimination: the build string of ``torch.__version__`` and the vendor's SMI tool
  (:func:`presenting_probe`). A marker that is absent says so in the probe's one-line reason.

Every probe returns ``(available, reason)``, the reason one line shown verbatim by ``glm5 backends``. SMI tools are run
through :func:`tool_output` (on PATH only, with a timeout); ``glm5_core.backends.simulated`` substitutes their
recorded outputs when a vendor's stack is simulated.
"""
from __future__ import annotations

import contextvars
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Optional

import torch

Probe = tuple[bool, str]
TOOL_TIMEOUT_S = 20

# tool name -> its recorded output (None: not on PATH), while a vendor's stack is simulated; None otherwise.
SIMULATED_TOOLS: contextvars.ContextVar[Optional[Mapping[str, Optional[str]]]] = contextvars.ContextVar(
    "glm5_simulated_tools", default=None)


def one_line(text: object, limit: int = 200) -> str:
    """``text`` on one line (a reason is one line), cut at ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def tool_output(tool: str, args: Sequence[str] = ()) -> tuple[Optional[str], str]:
    """(stdout, "") of ``tool args`` when it is on PATH and exits 0, else (None, why in one line)."""
    simulated = SIMULATED_TOOLS.get()
    if simulated is not None:
        output = simulated.get(tool)
        return (output, "") if output is not None else (None, f"{tool} is not on PATH")
    path = shutil.which(tool)
    if path is None:
        return None, f"{tool} is not on PATH"
    try:
        done = subprocess.run([path, *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, one_line(f"{tool} failed to run: {exc!r}")
    if done.returncode != 0:
        return None, one_line(f"{tool} exited {done.returncode}: {(done.stderr or done.stdout).strip()[:120]}")
    return done.stdout, ""


def tool_on_path(tool: str) -> bool:
    """Whether ``tool`` exists (not run)."""
    simulated = SIMULATED_TOOLS.get()
    if simulated is not None:
        return simulated.get(tool) is not None
    return shutil.which(tool) is not None


def build_words(words: Sequence[str]) -> list[str]:
    """The ``words`` that the torch build string (``torch.__version__``) contains, lower case."""
    version = str(torch.__version__).lower()
    return [w for w in words if w.lower() in version]


def _module_found(module: str) -> tuple[bool, str]:
    if module in sys.modules:
        return (True, "") if sys.modules[module] is not None else (False, f"{module} failed to import: it is "
                                                                           "blocked in sys.modules")
    try:
        return (importlib.util.find_spec(module) is not None, "")
    except (ImportError, ValueError) as exc:
        return False, one_line(f"{module} cannot be found: {exc!r}")


def extension_probe(module: str, device_type: str, visible_env: Optional[str], install: str) -> Probe:
    """A vendor's torch extension ``module`` registering device type ``device_type``: not installed, broken (fails to
    import, or its device query raises), no device, or ``N x <device name>``. Imports ``module`` once."""
    if getattr(torch, device_type, None) is None:
        found, why = _module_found(module)
        if not found:
            return False, why or f"{module} is not installed ({install})"
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken vendor stack must not break the others: one line says why
            return False, one_line(f"{module} failed to import: {exc!r}")
    device = getattr(torch, device_type, None)
    if device is None:
        return False, f"{module} imported but registered no torch.{device_type}"
    try:
        if not device.is_available():
            hint = f" (check {visible_env} and the driver)" if visible_env else ""
            return False, f"torch.{device_type}.is_available() is False{hint}"
        count = device.device_count()
        name = device.get_device_name(0) if hasattr(device, "get_device_name") else device_type
    except Exception as exc:
        return False, one_line(f"torch.{device_type} query failed: {exc!r}")
    visible = os.environ.get(visible_env) if visible_env else None
    return True, f"{count} x {name}" + (f" ({visible_env}={visible})" if visible else "")


def extension_count(module: str, device_type: str) -> int:
    """Devices of ``device_type`` this process sees, only when ``module`` is already imported (never imports it)."""
    device = getattr(torch, device_type, None) if module in sys.modules else None
    try:
        return int(device.device_count()) if device is not None and device.is_available() else 0
    except Exception:
        return 0


def presenting_probe(*, label: str, device_type: str, version_attr: str, tool: str,
                     tool_words: Sequence[str] = (), build_markers: Sequence[str] = ()) -> Probe:
    """A torch build that presents ``label``'s devices as ``device_type``: the build reports
    ``torch.version.<version_attr>`` and one of ``label``'s markers holds: the torch build string contains one of
    ``build_markers``, or ``tool`` (its SMI tool) runs and (if ``tool_words`` are given: the tool name is shared with
    another vendor) prints one of them. Then ``torch.<device_type>`` must see a device. Never decides by
    elimination: no marker, no backend."""
    built_for = getattr(torch.version, version_attr, None)
    if built_for is None:
        return False, f"this torch does not present {label} devices (torch.version.{version_attr} is None)"
    markers = [f"torch {torch.__version__}"] if build_words(build_markers) else []
    output, why = tool_output(tool)
    if output is not None:
        if not tool_words:
            markers.append(tool)
        elif any(word.lower() in output.lower() for word in tool_words):
            markers.append(f"{tool} lists a {label} device")
        else:
            why = f"{tool} runs but lists no {label} device (none of {', '.join(tool_words)})"
    if not markers:
        build = f"the torch build {torch.__version__!r} names none of {', '.join(build_markers)}; " \
            if build_markers else ""
        return False, one_line(f"no {label} marker: {build}{why}")
    device = getattr(torch, device_type)
    try:
        if not device.is_available():
            return False, f"{label} marker found ({markers[0]}) but torch.{device_type}.is_available() is False"
        count, name = device.device_count(), device.get_device_name(0)
    except Exception as exc:
        return False, one_line(f"torch.{device_type} query failed: {exc!r}")
    return True, one_line(f"{count} x {name} ({label}: {', '.join(markers)})")


def presenting_build(*, version_attr: str, tool: str, build_markers: Sequence[str] = (),
                     probe=None) -> bool:
    """Whether this torch build is the presenting vendor's (for ``DeviceFacts.this_torch``): the build string names
    the vendor, or its SMI tool is on PATH and (``probe``, the vendor's cached probe) says the devices are its."""
    if getattr(torch.version, version_attr, None) is None:
        return False
    if build_words(build_markers):
        return True
    return tool_on_path(tool) and probe is not None and bool(probe()[0])
