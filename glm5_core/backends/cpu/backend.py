"""Declaration of the ``cpu`` backend: always available; native kernels where the extension builds.

The C++/OpenMP extension (``csrc/cpu_*.cpp``) is built on first use, i.e. the first time an op resolves
on this backend (``kernel_table``), never at import. When it cannot be built (``GLM5_SKIP_EXT=1``, no
compiler, no ninja, a compile error) every op it backs runs the reference, and ``explain()`` / ``glm5 backends``
give the reason for each op. The kernels built on torch's own fused CPU ops (``TORCH_KERNEL_MODULES``: dense
MLA prefill through ``scaled_dot_product_attention``, mHC) need no extension and are always in the table.
"""
import importlib
from collections.abc import Iterator, Mapping

from glm5_core.backends.cpu.device import DEVICE
from glm5_core.registry import Backend, Kernel

# The modules whose ``KERNELS`` map ops to their native kernel records (importing them loads no extension:
# the ``torch.ops.glm5_cpu`` ops are looked up when a kernel runs).
KERNEL_MODULES = ("glm5_core.backends.cpu.dsa", "glm5_core.backends.cpu.dsa_selected_attention_target",
                  "glm5_core.backends.cpu.moe", "glm5_core.backends.cpu.muon", "glm5_core.backends.cpu.kda_native")
# The modules whose kernels call torch's own CPU kernels only: in the table whether or not the extension builds.
TORCH_KERNEL_MODULES = ("glm5_core.backends.cpu.mla", "glm5_core.backends.cpu.kda", "glm5_core.backends.cpu.mhc")


def _kernels_of(module_names) -> dict[str, Kernel]:
    table: dict[str, Kernel] = {}
    for module_name in module_names:
        table.update(importlib.import_module(module_name).KERNELS)
    return table


def native_kernels() -> dict[str, Kernel]:
    """Every extension kernel record, by op (whether or not the extension is built)."""
    return _kernels_of(KERNEL_MODULES)


def torch_kernels() -> dict[str, Kernel]:
    """The kernel records that need no extension, by op."""
    return _kernels_of(TORCH_KERNEL_MODULES)


# Why the ops without a native kernel keep the reference even when the extension is built.
REFERENCE_BY_CHOICE: Mapping[str, str] = {
    "mla_decode": "no native kernel: dense absorbed decode is GEMV-bound in the reference; use DSA sparse decode",
    "dsa_indexer_scores": "no native kernel: the full [B, T, S] score matrix is the output (the fused top-k avoids it)",
}


def status():
    """Build (first call only) and report the native extension: an ``ExtensionStatus``."""
    from glm5_core.backends.cpu import extension

    return extension.load()


def kernel_table() -> dict[str, Kernel]:
    return {**torch_kernels(), **(native_kernels() if status().built else {})}


class _MissingReasons(Mapping):
    """Per-op reason for running the reference; says whether the extension is built and why not."""

    def __getitem__(self, op: str) -> str:
        ext = status()
        if op in native_kernels():
            if ext.built:
                raise KeyError(op)
            return f"{ext.describe()}; running the reference"
        if op not in REFERENCE_BY_CHOICE:
            raise KeyError(op)
        return f"{REFERENCE_BY_CHOICE[op]} ({ext.describe()})"

    def __iter__(self) -> Iterator[str]:
        return iter(list(native_kernels()) + list(REFERENCE_BY_CHOICE))

    def __len__(self) -> int:
        return len(native_kernels()) + len(REFERENCE_BY_CHOICE)


BACKEND = Backend(
    name="cpu",
    facts=DEVICE,
    probe=lambda: (True, "always available"),
    kernel_table=kernel_table,
    missing=_MissingReasons(),
    description="CPU: C++/OpenMP kernels from csrc/ (built on first use), pure-torch reference elsewhere",
    details=lambda: status().describe(),
    detect=lambda: True,  # always here: the last resort of auto-detection
    priority=0,
)
