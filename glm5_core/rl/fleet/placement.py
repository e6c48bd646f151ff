"""Which accelerator each role of an RL run uses: ``train.device`` for the trainer, ``rollout.devices`` for the
engines (one entry per engine, or one for all), each ``<device type>:<index>`` (or the host device, ``cpu``).

The device types, their visible-devices variables, Ray resources and device counts are the vendors' device facts
(:mod:`glm5_core.device_kinds`): a vendor's device type is accepted here without an edit. Devices are checked
against what the vendors' counts see (a ``ValueError`` naming the key otherwise). A local engine worker is given
only its own accelerator (the vendor's visible-devices variable set to its index, so inside the worker it is
device 0); on the host device an entry may name a CPU core set (``cpu:0-1``, ``cpu:2``, ``cpu:0-1+4``): the
process placed there pins itself to those cores with ``os.sched_setaffinity`` and runs one torch thread per
core, so the trainer and the engines never share a core (overlapping sets and cores outside
``os.sched_getaffinity(0)`` are refused); a Ray actor asks Ray for one (the vendor's Ray resource) and Ray sets
the visibility. Nothing here imports a vendor SDK; :func:`probe_accelerators` asks the vendors' counts at call time.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from glm5_core.device_facts import DeviceFacts
from glm5_core.rl.config import (  # noqa: F401 (importable here too)
    check_core_sets,
    check_engine_devices,
    core_set,
    parse_device,
    parse_devices,
)

Probe = Callable[[], dict[str, int]]


def _device_types() -> dict[str, DeviceFacts]:
    from glm5_core import device_kinds

    return device_kinds.device_types()


def probe_accelerators() -> dict[str, int]:
    """Accelerators this process sees, by device type (each vendor's count: none imports a vendor SDK)."""
    return {kind: facts.count() for kind, facts in _device_types().items() if not facts.is_host}


def check_visible(devices: list[str], where: str, probe: Probe) -> None:
    counts: Optional[dict[str, int]] = None
    kinds = _device_types()
    for _i, device in enumerate(devices):
        kind, index = parse_device(device, where)
        if kinds[kind].is_host:
            check_cores(core_set(device, where), where, device)
            continue
        counts = probe() if counts is None else counts
        if index >= counts.get(kind, 0):
            seen = counts.get(kind, 0)
            raise ValueError(f"{where}: {device} is not visible here: the platform probe sees {seen} {kind} "
                             f"device{'s' if seen != 1 else ''}" + (f" ({kind}:0..{kind}:{seen - 1})" if seen else ""))


def allowed_cores() -> Optional[set[int]]:
    """The cores this process may run on (``os.sched_getaffinity(0)``), None where the platform cannot pin."""
    getter = getattr(os, "sched_getaffinity", None)
    return None if getter is None else set(getter(0))


def check_cores(cores: Optional[tuple[int, ...]], where: str, device: str) -> None:
    """``ValueError`` naming ``where`` unless every core of ``cores`` is one this process may run on."""
    if cores is None:
        return
    allowed = allowed_cores()
    if allowed is None or not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{where}: core sets need os.sched_setaffinity, which this platform lacks; use the bare "
                         f"host device, got {device}")
    missing = sorted(set(cores) - allowed)
    if missing:
        raise ValueError(f"{where}: cores {missing} of {device} are not in this process's affinity "
                         f"{sorted(allowed)} (os.sched_getaffinity(0))")


def cpu_cores(device: Optional[str]) -> Optional[tuple[int, ...]]:
    """The cores a process placed on ``device`` pins itself to (None: an accelerator or the bare host device)."""
    return None if device is None else core_set(device, "device")


def pin_trainer(device: Optional[str], threads: int) -> Optional[tuple[int, ...]]:
    """Pin this (the trainer's) process to ``device``'s core set with one torch thread per core, or set
    ``threads`` torch threads where ``device`` names no core set; the cores pinned to, or None."""
    import torch

    cores = cpu_cores(device)
    if cores is None:
        torch.set_num_threads(threads)
        return None
    from glm5_core.rl.serving.worker import set_process_affinity

    set_process_affinity(cores)
    torch.set_num_threads(len(cores))
    return cores


def engine_devices(devices: Optional[Any], num_engines: int, where: str = "rollout.devices") -> list[Optional[str]]:
    """One device (or None: the backend's default) per engine."""
    check_engine_devices(devices, num_engines, where)
    if devices is None:
        return [None] * num_engines
    parsed = parse_devices(devices, where)
    return parsed * num_engines if len(parsed) == 1 else parsed


def worker_environment(device: Optional[str]) -> dict[str, str]:
    """Environment of a local worker process that uses ``device`` (only that accelerator visible)."""
    if device is None:
        return {}
    kind, index = parse_device(device, "device")
    facts = _device_types()[kind]
    return {} if facts.is_host else dict(facts.worker_environment(index))


def in_worker_device(device: Optional[str]) -> Optional[str]:
    """The torch device a worker with :func:`worker_environment` uses: its only visible accelerator is 0."""
    if device is None:
        return None
    kind, _ = parse_device(device, "device")
    return kind if _device_types()[kind].is_host else f"{kind}:0"


def ray_resources(device: Optional[str]) -> dict[str, Any]:
    """``.options(...)`` of a Ray actor that uses ``device``."""
    if device is None:
        return {}
    kind, _ = parse_device(device, "device")
    return dict(_device_types()[kind].ray_options())
