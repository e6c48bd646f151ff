"""What a conformance check is (:class:`Check`), what running one gives (:class:`Result`), the form of a
gradient case (:data:`GradCase`), and the helpers every family's checks share."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Callable, Optional

import torch

from glm5_core import device_kinds, testing

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}

CheckFn = Callable[[str, str], testing.Comparison]  # (backend, device) -> comparison
# A gradient case: (entry point call taking the backend first, reference call, float inputs to differentiate).
GradCase = tuple[Callable, Callable, dict[str, torch.Tensor]]


class NotRunnable(Exception):
    """A check that cannot run where it was asked (e.g. it needs two devices and one is visible): reported as
    ``not_run`` with the reason, neither passed nor failed."""


@dataclasses.dataclass(frozen=True)
class Check:
    family: str
    name: str
    ops: Sequence[str]
    fn: CheckFn
    # False: a property (determinism, two forms agreeing) worth checking on the reference too
    against_reference: bool = True

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass
class Result:
    family: str
    check: str
    ops: list[str]
    status: str  # "pass" | "fail" | "error" | "fallback" | "not_run"
    max_error: Optional[float]
    allowed: Optional[float]
    detail: str
    seconds: float


def reference_device(device: torch.device) -> torch.device:
    """Where an fp64 reference of inputs on ``device`` runs: there, or the CPU when its device type computes no fp64
    (its vendor's ``DeviceFacts.dtypes``): such a backend is judged against a CPU fp64 reference."""
    facts = device_kinds.facts_for(device.type)
    return device if facts is None or facts.supports(torch.float64) else torch.device("cpu")


def fp64(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` with every floating tensor in fp64 (integer tensors keep their dtype), all on the
    :func:`reference_device` of the first one."""
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    where = reference_device(tensors[0].device) if tensors else None
    return {k: (v.to(where, torch.float64) if v.is_floating_point() else v.to(where))
            if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def check_dtypes(check: Check) -> list[torch.dtype]:
    """The dtypes a check's name tags (``name[fp64-...]``): what its inputs are made in."""
    by_name = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    return [by_name[tag] for tag in re.findall(r"(?<=[\[\-])(fp32|bf16|fp16|fp64)(?=[\]\-])", check.name)]
