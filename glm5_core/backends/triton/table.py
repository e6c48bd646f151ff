"""Build a backend's kernel table from the Triton kernel modules and a vendor's launch configs.

The kernel modules are the modules of this package that declare ``FAMILY`` (``kernel_families()`` finds them,
in sorted order); each carries, next to its kernels:

  FAMILY                            its launch family (the module's name): ``configs[FAMILY]`` is its launch
                                    configuration, the vendor's override or
  DEFAULT_LAUNCH                    its default LaunchConfig
  ITEMSIZES                         the input element sizes (bytes) it is launched with
  tiles(blocks, dims, itemsize)     {kernel: [shared_memory.Tile]}: what each of its kernels holds in shared memory
  kernels(configs)                  {op: Kernel}: the ops it serves, its entries of the kernel table

This module and ``shared_memory`` only iterate those modules: a new Triton kernel is its module (a vendor's table
names it only to launch it differently). Imported without triton (the kernel modules are found and imported by
``kernel_families``, from ``build_kernel_table``), so a vendor's ``backend.py`` can read ``MISSING`` at import.
"""
from __future__ import annotations

import importlib
import pkgutil
import types
from typing import Dict, List, Tuple

from glm5_core.backends.triton.launch import KernelConfigs
from glm5_core.kernel import Kernel

# Ops no Triton kernel implements, and why (shown by `glm5 backends` for every Triton vendor). An op absent from
# both the table and this mapping gets the registry's default reason, derived from its OpSpec.
MISSING = {
    "mla_prefill": "dense MLA prefill is left to torch (SDPA-class kernels); DSA's sparse path is the Triton kernel",
    "dsa_sparse_prefill_expanded": "no Triton kernel for the expanded (per-head keys) sparse prefill yet: the "
                                   "reference runs; dsa_sparse_prefill (absorbed) is the Triton kernel",
    "dsa_selected_index_scores": "no Triton kernel for the indexer scores at the selected keys yet: the "
                                 "reference (gathers over the K selected keys, no [T, S] tensor) runs",
}


def kernel_families() -> Tuple[str, ...]:
    """The names of this package's modules that declare ``FAMILY``, sorted (imports every module: triton)."""
    package = importlib.import_module(__package__)
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    return tuple(name for name in names if hasattr(importlib.import_module(f"{__package__}.{name}"), "FAMILY"))


def kernel_module(family: str) -> types.ModuleType:
    """The kernel module of launch family ``family`` (imports triton)."""
    families = kernel_families()
    if family not in families:
        raise KeyError(f"family: no Triton kernel module {family!r} (the kernel modules are: {', '.join(families)})")
    module = importlib.import_module(f"{__package__}.{family}")
    assert module.FAMILY == family, f"{module.__name__}.FAMILY is {module.FAMILY!r}: the family is the module's name"
    return module


def kernel_modules() -> List[types.ModuleType]:
    return [kernel_module(family) for family in kernel_families()]


def build_kernel_table(configs: KernelConfigs) -> Dict[str, Kernel]:
    """Every kernel module's entries with ``configs``' launch configurations, then the inference ops as
    torch.library custom ops (``custom_ops``: torch.compile sees one node per op)."""
    from glm5_core.backends.triton import custom_ops

    configs.launches()  # every override names a kernel module
    table: Dict[str, Kernel] = {}
    for module in kernel_modules():
        for op, kernel in module.kernels(configs).items():
            assert op not in table, f"{op}: served by two Triton kernel modules"
            table[op] = kernel
    table.update(custom_ops.register(configs))
    return table
