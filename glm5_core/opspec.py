"""How an op is declared: one :class:`OpSpec`, in its family module next to its reference.

Each family module of ``glm5_core.ops`` (listed once, in ``glm5_core.ops.FAMILY_MODULES``) ends with a tuple
``OPS`` of its specs; the registry reads them when first asked and derives everything else from them (the op
names, the references, the composite ops and their parts, the ops whose gradients the conformance suite
checks). Nothing is registered by import side effects.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One dispatchable op.

    ``reference``: the pure-torch implementation, the spec every backend is checked against; it takes the
    arguments the entry point passes to ``registry.call``.
    ``family``: the conformance family (``glm5_core.conformance.FAMILIES``) whose checks cover the op.
    ``differentiable``: training needs this op's gradient; the reference gives it, and the ``gradients``
    conformance family checks that every backend keeps it.
    ``gradient_free``: the op's outputs carry no gradient (integer indices, as the top-k): a kernel takes its
    calls even when an input requires grad, since no backward is ever asked of it.
    ``composite`` / ``parts``: a composite op (as torch's CompositeImplicitAutograd): a backend without a fused
    kernel for it runs ``composite(*args, backend=..., **kwargs)``, which calls the backend's kernels for
    ``parts`` (each part falling back on its own), never the whole reference.
    """

    name: str
    reference: Callable
    family: str
    differentiable: bool = False
    gradient_free: bool = False
    composite: Optional[Callable] = None
    parts: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name: expected an identifier such as 'moe_route', got {self.name!r}")
        if not callable(self.reference):
            raise TypeError(f"{self.name}: reference: expected a callable, got {type(self.reference).__name__}")
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"{self.name}: family: expected a conformance family name, got {self.family!r}")
        if not isinstance(self.differentiable, bool):
            raise TypeError(f"{self.name}: differentiable: expected a bool, got {type(self.differentiable).__name__}")
        if not isinstance(self.gradient_free, bool):
            raise TypeError(f"{self.name}: gradient_free: expected a bool, got {type(self.gradient_free).__name__}")
        if self.gradient_free and self.differentiable:
            raise ValueError(f"{self.name}: an op is either differentiable or gradient_free, got both")
        if (self.composite is None) != (not self.parts):
            raise ValueError(f"{self.name}: a composite op declares both composite and parts, got "
                             f"composite={self.composite!r}, parts={self.parts!r}")
        if self.composite is not None and not callable(self.composite):
            raise TypeError(f"{self.name}: composite: expected a callable, got {type(self.composite).__name__}")
        if not isinstance(self.parts, tuple) or not all(isinstance(p, str) for p in self.parts):
            raise TypeError(f"{self.name}: parts: expected a tuple of op names, got {self.parts!r}")

    @property
    def is_composite(self) -> bool:
        return self.composite is not None


def target_of(fn: Callable) -> str:
    """``"module:qualname"`` of a function (the form the registry's derived path tables use)."""
    return f"{fn.__module__}:{fn.__qualname__}"
