"""Where the RL driver puts its models and tensors: the runtime device of the kernel backend.

``glm5 rl --backend auto|<name>`` resolves a backend name; the policy, the teacher and every engine
model are moved to that backend's :meth:`~glm5_core.registry.Backend.device` (``cpu`` for the CPU backend
and for Triton's interpreter). The engine and the trainer then create their tensors on the device of the
model they were given (:func:`module_device`), so nothing else needs to know the backend.
"""
from __future__ import annotations

from typing import Optional

import torch


def runtime_device(backend: Optional[str]) -> torch.device:
    """The torch device of backend ``backend`` (``None`` / ``"auto"``: the resolved default backend).

    Raises ``BackendUnavailableError`` when that backend cannot run here."""
    from glm5_core import registry

    name = registry.resolve_backend_name(backend)
    return torch.device(registry.require_available(name).device())


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (``cpu`` for a module without parameters)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
