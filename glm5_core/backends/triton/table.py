"""Build a backend's kernel table from the Triton kernel modules and a vendor's launch configs.

The kernel modules are the modules of this package that declare ``FAMILY`` (``kernel_modules.kernel_families()``
finds them, in sorted order); each carries, next to its kernels:

  FAMILY                            its launch family (the module's name): ``configs.get(FAMILY,
                                    DEFAULT_LAUNCH)`` is its launch configuration, the vendor's override or
  DEFAULT_LAUNCH                    its default LaunchConfig
  ITEMSIZES                         the input element sizes (bytes) it is launched with
  tiles(blocks, dims, itemsize)     {kernel: [shared_memory.Tile]}: what each of its kernels holds in shared memory
  kernels(configs)                  {op: Kernel}: the ops it serves, its entries of the kernel table

This module and ``shared_memory`` only iterate those modules: a new Triton kernel is its module (a vendor's table
names it only to launch it differently). Imported without triton (the kernel modules are found and imported by
``kernel_families``, from ``build_kernel_table``), so a vendor's ``backend.py`` can read ``MISSING`` at import.
"""
from __future__ import annotations

from glm5_core.backends.triton.kernel_modules import kernel_families, kernel_module, kernel_modules
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig
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


def launch_config(configs: KernelConfigs, family: str) -> LaunchConfig:
    """The launch configuration ``configs``' vendor launches ``family`` with: its override, else the kernel
    module's ``DEFAULT_LAUNCH`` (a family that is no kernel module is a KeyError naming the vendor and it)."""
    try:
        return configs.get(family, kernel_module(family).DEFAULT_LAUNCH)
    except KeyError as error:
        raise KeyError(f"the {configs.vendor} launch table: {error.args[0]}") from None


def launches(configs: KernelConfigs) -> dict[str, LaunchConfig]:
    """{family: effective launch configuration} of ``configs``' vendor for every kernel module; an override of a
    family that is no kernel module is a KeyError naming the vendor and the family."""
    families = kernel_families()
    unknown = sorted(set(configs.overrides) - set(families))
    if unknown:
        raise KeyError(f"the {configs.vendor} launch table overrides {', '.join(map(repr, unknown))}, which is no "
                       f"Triton kernel module (they are: {', '.join(families)})")
    return {family: launch_config(configs, family) for family in families}


def build_kernel_table(configs: KernelConfigs) -> dict[str, Kernel]:
    """Every kernel module's entries with ``configs``' launch configurations, then the inference ops as
    torch.library custom ops (``custom_ops``: torch.compile sees one node per op)."""
    from glm5_core.backends.triton import custom_ops

    launches(configs)  # every override names a kernel module
    table: dict[str, Kernel] = {}
    for module in kernel_modules():
        for op, kernel in module.kernels(configs).items():
            assert op not in table, f"{op}: served by two Triton kernel modules"
            table[op] = kernel
    table.update(custom_ops.register(configs))
    return table
