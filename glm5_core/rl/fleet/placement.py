"""Which accelerator each role of an RL run uses: ``train.device`` for the trainer, ``rollout.devices`` for the
engines (one entry per engine, or one for all), e.g. ``cuda:0`` / ``cuda:1,cuda:2`` or ``npu:0``.

Devices are checked against what the platform probe sees (a ``ValueError`` naming the key otherwise). A local
engine worker is given only its own accelerator (``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` set
to its index, so inside the worker it is device 0); a Ray actor asks Ray for one (``num_gpus=1``, or the
``NPU`` resource) and Ray sets the visibility. Nothing here imports a vendor SDK; :func:`probe_accelerators`
asks torch at call time.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Tuple

KINDS = ("cpu", "cuda", "npu")
VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
_DEVICE = re.compile(r"(cpu|cuda|npu)(?::(\d{1,4}))?")

Probe = Callable[[], Dict[str, int]]


def parse_device(text: Any, where: str) -> Tuple[str, Optional[int]]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"cpu"`` -> ``("cpu", None)``; ``ValueError`` naming ``where``."""
    match = _DEVICE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{where}: expected a device such as 'cpu', 'cuda:0' or 'npu:1', got {text!r:.80}")
    kind, index = match.group(1), match.group(2)
    if kind != "cpu" and index is None:
        raise ValueError(f"{where}: expected an index for {kind} (e.g. '{kind}:0'), got {text!r:.80}")
    return kind, None if index is None else int(index)


def parse_devices(value: Any, where: str) -> List[str]:
    """A list of devices from ``"cuda:1,cuda:2"`` or ``["cuda:1", "cuda:2"]`` (normalised, checked)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{where}: expected devices such as 'cuda:1,cuda:2' or a list of them, got {value!r:.80}")
    out = []
    for i, item in enumerate(items):
        kind, index = parse_device(item, f"{where}[{i}]")
        out.append(kind if index is None else f"{kind}:{index}")
    return out


def probe_accelerators() -> Dict[str, int]:
    """Accelerators torch sees here, by kind (``npu`` only when ``torch_npu`` was already imported)."""
    import sys

    import torch

    counts = {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0, "npu": 0}
    npu = getattr(torch, "npu", None) if "torch_npu" in sys.modules else None
    if npu is not None and npu.is_available():
        counts["npu"] = npu.device_count()
    return counts


def check_visible(devices: List[str], where: str, probe: Probe) -> None:
    counts: Optional[Dict[str, int]] = None
    for i, device in enumerate(devices):
        kind, index = parse_device(device, where)
        if kind == "cpu":
            continue
        counts = probe() if counts is None else counts
        if index >= counts.get(kind, 0):
            seen = counts.get(kind, 0)
            raise ValueError(f"{where}: {device} is not visible here: the platform probe sees {seen} {kind} "
                             f"device{'s' if seen != 1 else ''}" + (f" ({kind}:0..{kind}:{seen - 1})" if seen else ""))


def check_engine_devices(devices: Optional[Any], num_engines: int, where: str = "rollout.devices") -> None:
    """ValueError naming ``where`` unless ``devices`` gives one device per engine, one for all, or None; nothing
    of ``num_engines``' size is built (a config is checked with this before its sizes are)."""
    if devices is None:
        return
    parsed = parse_devices(devices, where)
    if len(parsed) not in (1, num_engines):
        raise ValueError(f"{where}: expected one device per engine (rollout.num_engines={num_engines}) or one for "
                         f"all, got {len(parsed)}: {','.join(parsed)}")


def engine_devices(devices: Optional[Any], num_engines: int, where: str = "rollout.devices") -> List[Optional[str]]:
    """One device (or None: the backend's default) per engine."""
    check_engine_devices(devices, num_engines, where)
    if devices is None:
        return [None] * num_engines
    parsed = parse_devices(devices, where)
    return parsed * num_engines if len(parsed) == 1 else parsed


def worker_environment(device: Optional[str]) -> Dict[str, str]:
    """Environment of a local worker process that uses ``device`` (only that accelerator visible)."""
    if device is None:
        return {}
    kind, index = parse_device(device, "device")
    return {VISIBLE_DEVICES_ENV[kind]: str(index)} if kind in VISIBLE_DEVICES_ENV else {}


def in_worker_device(device: Optional[str]) -> Optional[str]:
    """The torch device a worker with :func:`worker_environment` uses: its only visible accelerator is 0."""
    if device is None:
        return None
    kind, _ = parse_device(device, "device")
    return "cpu" if kind == "cpu" else f"{kind}:0"


def ray_resources(device: Optional[str]) -> Dict[str, Any]:
    """``.options(...)`` of a Ray actor that uses ``device``."""
    if device is None:
        return {}
    kind, _ = parse_device(device, "device")
    if kind == "cuda":
        return {"num_gpus": 1}
    if kind == "npu":
        return {"resources": {"NPU": 1}}
    return {}
