"""A worker's view of its placement: the executor that starts a worker turns the spec's ``placement`` (a
``rollout.devices`` entry, :mod:`glm5_core.rl.fleet.placement`) into the torch device the engine uses inside the
worker and the environment that makes only that accelerator visible (or, for a host-device core set, the cores
the worker pins itself to), so the serving layer reads no placement rule.
"""
from __future__ import annotations

import dataclasses

from glm5_core.rl.fleet.placement import cpu_cores, in_worker_device, worker_environment
from glm5_core.rl.serving.worker import WorkerSpec


def placed(spec: WorkerSpec) -> WorkerSpec:
    """``spec`` with ``device`` and ``environment`` derived from ``spec.placement`` (a Ray actor applies no
    environment: Ray makes its accelerator visible)."""
    return dataclasses.replace(spec, device=in_worker_device(spec.placement),
                               environment=worker_environment(spec.placement), cpu_cores=cpu_cores(spec.placement))
