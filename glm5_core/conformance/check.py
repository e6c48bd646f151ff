"""What a conformance check is (:class:`Check`), what running one gives (:class:`Result`), the form of a
gradient case (:data:`GradCase`), and the helpers every family's checks share."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Callable, Optional

import torch

from glm5_core import testing

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


def fp64(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` with every floating tensor in fp64 (integer tensors unchanged)."""
    return {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in inputs.items()}
