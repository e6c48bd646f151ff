"""What hardware is really here: cached, import-safe probes.

Nothing in this module runs at ``import glm5_core`` time. Each probe runs on first use and is cached
for the life of the process, so no device runtime is initialised twice. Vendor SDKs (``torch_npu``,
``triton``) are imported only inside the probe that needs them.

Every probe returns ``(available: bool, reason: str)``; the reason is shown to users verbatim.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Tuple

import torch

Probe = Tuple[bool, str]


def triton_interpreter_enabled() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors through Triton's interpreter.

    Read the way Triton reads it (1, true, on, yes, y in any case; anything else is off), so that
    ``TRITON_INTERPRET=false`` means the same thing to both."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def is_rocm_build() -> bool:
    """ROCm builds of torch report device type ``cuda``; only ``torch.version.hip`` tells them apart."""
    return getattr(torch.version, "hip", None) is not None


@functools.lru_cache(maxsize=None)
def triton_probe() -> Probe:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'glm5-core[cuda]')"
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # a broken install must not break `import glm5_core`
        return False, f"triton failed to import: {exc!r}"
    return True, f"triton {getattr(triton, '__version__', '?')}"


@functools.lru_cache(maxsize=None)
def gpu_probe(vendor: str) -> Probe:
    """Probe an NVIDIA (``vendor='cuda'``) or AMD (``vendor='rocm'``) GPU through torch."""
    if vendor not in ("cuda", "rocm"):
        raise ValueError(f"vendor: expected 'cuda' or 'rocm', got {vendor!r}")
    rocm = is_rocm_build()
    if vendor == "cuda" and rocm:
        return False, f"this torch is a ROCm build (hip {torch.version.hip}); use the rocm backend"
    if vendor == "rocm" and not rocm:
        return False, "this torch is not a ROCm build (torch.version.hip is None)"
    if vendor == "cuda" and torch.version.cuda is None:
        return False, "this torch is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False (no GPU visible to this process)"
    name = torch.cuda.get_device_name(0)
    return True, f"{torch.cuda.device_count()} x {name}"


@functools.lru_cache(maxsize=None)
def npu_probe() -> Probe:
    """Ascend NPU: find torch_npu, import it once, then ask ``torch.npu.is_available()``.

    Since torch 2.5 torch_npu may already be loaded by ``import torch`` (device-backend autoload);
    in that case it is not imported again.
    """
    if not hasattr(torch, "npu"):
        if importlib.util.find_spec("torch_npu") is None:
            return False, "torch_npu is not installed (pip install 'glm5-core[ascend]')"
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:
            return False, f"torch_npu failed to import: {exc!r}"
    try:
        if not torch.npu.is_available():
            return False, "torch.npu.is_available() is False (check ASCEND_RT_VISIBLE_DEVICES and the CANN driver)"
        count = torch.npu.device_count()
    except Exception as exc:
        return False, f"torch.npu query failed: {exc!r}"
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    suffix = f" (ASCEND_RT_VISIBLE_DEVICES={visible})" if visible else ""
    return True, f"{count} Ascend NPU(s){suffix}"


def triton_interpreter_too_late() -> str:
    """Why Triton's interpreter cannot run kernels in this process ('' when it can).

    Triton decorates its own ``triton.language`` helpers when triton is imported: if that happened
    before ``TRITON_INTERPRET=1`` was set, interpreted kernels fail on the first helper they call."""
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(getattr(standard, "zeros", None)).__name__ == "JITFunction":
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before Python starts"
    return ""


def triton_backend_probe(vendor: str) -> Probe:
    """Availability of a Triton backend (``cuda`` or ``rocm``): a matching GPU and triton, or the
    interpreter on CPU tensors when ``TRITON_INTERPRET=1``."""
    ok, why = triton_probe()
    if triton_interpreter_enabled():
        if not ok:
            return False, f"TRITON_INTERPRET=1 but {why}"
        late = triton_interpreter_too_late()
        if late:
            return False, late
        return True, f"Triton interpreter on CPU tensors (TRITON_INTERPRET=1), {why}"
    gpu_ok, gpu_why = gpu_probe(vendor)
    if not gpu_ok:
        return False, gpu_why
    if not ok:
        return False, why
    return True, f"{gpu_why}, {why}"


def triton_runtime_device() -> str:
    """Where a Triton backend's tensors live: ``cpu`` under the interpreter, else ``cuda`` (ROCm builds of
    torch expose AMD GPUs under the ``cuda`` device type too)."""
    return "cpu" if triton_interpreter_enabled() else "cuda"
