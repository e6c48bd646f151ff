"""The Triton kernel modules: the modules of this package that declare ``FAMILY`` (their protocol is in
``table.py``), found by name, so no list of them is kept. Imported without triton; ``kernel_families`` imports
every module of the package (so triton), when the kernel table or the shared-memory estimate asks."""
from __future__ import annotations

import importlib
import pkgutil
import types

PACKAGE = __name__.rpartition(".")[0]


def kernel_families() -> tuple[str, ...]:
    """The names of this package's modules that declare ``FAMILY``, sorted (imports every module: triton)."""
    package = importlib.import_module(PACKAGE)
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    return tuple(name for name in names if hasattr(importlib.import_module(f"{PACKAGE}.{name}"), "FAMILY"))


def kernel_module(family: str) -> types.ModuleType:
    """The kernel module of launch family ``family`` (imports triton)."""
    families = kernel_families()
    if family not in families:
        raise KeyError(f"family: no Triton kernel module {family!r} (the kernel modules are: {', '.join(families)})")
    module = importlib.import_module(f"{PACKAGE}.{family}")
    assert module.FAMILY == family, f"{module.__name__}.FAMILY is {module.FAMILY!r}: the family is the module's name"
    return module


def kernel_modules() -> list[types.ModuleType]:
    return [kernel_module(family) for family in kernel_families()]
