"""The torch_npu namespace and the capability checks shared by the Ascend kernels.

Every kernel takes its vendor namespace as the keyword ``npu`` (default: the real ``torch_npu``, imported on
first use, never at import time). Tests pass an executable statement of the documented operator semantics
instead, so the argument building is checked on machines without an NPU.

A capability check returns ``(ok, why)``; the registry runs the reference, with ``why`` in ``explain()``,
when a call is declined. Each kernel module splits its check in two: ``<op>_limits`` (the vendor op's
documented limits: shapes, dtypes, sizes; device-independent, so CPU tests exercise it) and the
``supports`` hook of its :class:`~glm5_core.kernel.Kernel` record (:func:`npu_kernel`), which adds "the
tensors live on an NPU" and "this torch_npu has the operator". The fused vendor ops used here are documented
for inference (no autograd formula registered): the records are not ``differentiable``, so the registry runs
the differentiable reference for every call that needs gradients.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch

from glm5_core.kernel import Kernel

Decision = tuple[bool, str]
OK: Decision = (True, "")
HALF_DTYPES = (torch.float16, torch.bfloat16)


def vendor_ops(npu: Optional[Any] = None) -> Any:
    """The namespace holding the ``npu_*`` operators: ``npu`` if given, else the real torch_npu."""
    if npu is not None:
        return npu
    return importlib.import_module("torch_npu")


def first_output(result: Any) -> torch.Tensor:
    """Ops documented as returning ``(Tensor, ...)`` or a list return their first output; others a tensor."""
    if isinstance(result, (tuple, list)):
        return result[0]
    return result


def on_npu(tensors: Iterable[Optional[torch.Tensor]]) -> Decision:
    for t in tensors:
        if t is not None and t.device.type != "npu":
            return False, f"tensors are on {t.device.type}, torch_npu kernels need npu tensors"
    return OK


def dtype_in(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype], op_name: str) -> Decision:
    if t.dtype not in allowed:
        names = "/".join(str(d).replace("torch.", "") for d in allowed)
        return False, f"{op_name} takes {name} in {names}, got {t.dtype}"
    return OK


def has_operator(op_name: str, npu: Optional[Any] = None) -> Decision:
    """Older torch_npu releases lack the newer fused ops: decline with the version instead of failing."""
    ops = vendor_ops(npu)
    if not hasattr(ops, op_name):
        return False, f"torch_npu {getattr(ops, '__version__', '?')} has no {op_name}"
    return OK


def npu_kernel(fn: Callable, limits: Callable[..., Decision],
               tensors_of: Callable[..., Sequence[Optional[torch.Tensor]]], op_name: str) -> Kernel:
    """``fn`` as a kernel record whose ``supports`` checks: NPU tensors, the operator present in this
    torch_npu, then the op's documented ``limits``. Not differentiable (see the module docstring)."""

    def supports(*args, **kwargs) -> Decision:
        decision = on_npu(tensors_of(*args, **kwargs))
        if decision[0]:
            decision = has_operator(op_name)  # torch_npu is imported by now: the probe did it
        return decision if not decision[0] else limits(*args, **kwargs)

    return Kernel(fn, supports=supports)
