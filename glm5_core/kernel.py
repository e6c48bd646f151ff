"""What a backend's kernel table holds for one op: a :class:`Kernel` record.

``fn`` takes exactly the arguments the op's public entry point passes to ``registry.call`` (already validated).
``supports(*args, **kwargs) -> (ok, why)`` may decline a call outside the kernel's capabilities (dtype, device,
sizes); the reference then runs, and ``why`` is what ``record_fallbacks`` / strict mode report. A kernel
without a backward keeps ``differentiable=False``: the registry routes every call that needs gradients to the
differentiable reference before ``supports`` is asked, so a ``supports`` hook never has to look at
``requires_grad``. Calls of an op whose outputs carry no gradient (``OpSpec.gradient_free``: top-k indices)
need no backward, whatever their inputs require: the kernel takes them.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional

import torch

Decision = tuple[bool, str]  # (the kernel takes the call, why not)

NO_BACKWARD = "the kernel has no backward and this call needs gradients"


def needs_grad(*args, **kwargs) -> bool:
    """Autograd is recording and some tensor argument requires a gradient."""
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in itertools.chain(args, kwargs.values()))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One backend implementation of one op, with its capabilities.

    Calling the record calls ``fn`` (so ``registry.resolve(op).impl(...)`` runs the kernel as before)."""

    fn: Callable
    supports: Optional[Callable[..., Decision]] = None
    differentiable: bool = False
    note: str = ""  # when ``supports`` takes calls, for a kernel that serves one setting only (glm5 backends shows it)

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"fn: expected a callable kernel, got {type(self.fn).__name__}")
        if self.supports is not None and not callable(self.supports):
            raise TypeError("supports: expected None or a callable returning (ok, why), "
                            f"got {type(self.supports).__name__}")
        if not isinstance(self.differentiable, bool):
            raise TypeError(f"differentiable: expected a bool, got {type(self.differentiable).__name__}")
        if not isinstance(self.note, str):
            raise TypeError(f"note: expected a str, got {type(self.note).__name__}")

    @classmethod
    def of(cls, entry) -> Kernel:
        """``entry`` as a record. A bare callable (the form out-of-tree tables used before records) is wrapped,
        its ``supports`` / ``differentiable`` function attributes read once, when the kernel table is loaded."""
        if isinstance(entry, Kernel):
            return entry
        if not callable(entry):
            raise TypeError(f"kernel table entry: expected a Kernel or a callable, got {type(entry).__name__}")
        return cls(entry, getattr(entry, "supports", None), bool(getattr(entry, "differentiable", False)))

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def declines(self, args: tuple, kwargs: dict, *, outputs_have_gradients: bool = True) -> str:
        """Why this kernel cannot take the call ('' when it can): gradients it cannot give (only asked of ops
        whose outputs have gradients), then ``supports``."""
        if outputs_have_gradients and not self.differentiable and needs_grad(*args, **kwargs):
            return NO_BACKWARD
        if self.supports is not None:
            ok, why = self.supports(*args, **kwargs)
            if not ok:
                return why
        return ""

    @property
    def name(self) -> str:
        """``module.qualname`` of ``fn`` (what ``explain`` shows)."""
        fn = self.fn
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
