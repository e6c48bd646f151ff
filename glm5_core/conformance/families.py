"""The conformance families, derived from the op declarations, and where each family's checks live.

Each op's ``OpSpec.family`` (its declaration in ``glm5_core.ops``) names the family whose checks cover it. The
families are those names in declaration order, then the properties checked across the op families
(:data:`PROPERTY_FAMILIES`: the gradients of every differentiable op, determinism). Family ``f``'s checks are
``checks()`` of the module ``glm5_core.conformance.<f>``: a new op's checks are an edit of its family's module
(its backward inputs too, see ``gradients.py``), a new family is one new module; the runner, the reports and
the CLI follow from here.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

from glm5_core import registry
from glm5_core.conformance.check import Check

PROPERTY_FAMILIES = ("gradients", "determinism")


def op_families() -> tuple[str, ...]:
    """The ``family`` of every declared op, once each, in declaration order."""
    return tuple(dict.fromkeys(spec.family for spec in registry.op_specs().values()))


def family_names() -> tuple[str, ...]:
    """Every conformance family: the ops' families, then :data:`PROPERTY_FAMILIES`."""
    return op_families() + PROPERTY_FAMILIES


FAMILIES = family_names()


def family_module(family: str) -> ModuleType:
    """The module holding ``family``'s checks: ``glm5_core.conformance.<family>``, with a ``checks()``."""
    name = f"{__package__}.{family}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        module = None
    if module is None or not callable(getattr(module, "checks", None)):
        ops = [op for op, spec in registry.op_specs().items() if spec.family == family]
        raise ValueError(f"family {family!r} (of {', '.join(ops) or 'no op'}): expected its checks in a function "
                         f"checks() of {name}, got none")
    return module


def checks(family: Optional[str] = None) -> list[Check]:
    """All conformance checks, or those of one family."""
    names = family_names()
    if family is not None and family not in names:
        raise ValueError(f"family: expected one of {names}, got {family!r}")
    return [c for fam in ([family] if family else names) for c in family_module(fam).checks()]
