"""Declaration of the ``rocm`` backend. Import-light: triton / aiter are imported only by ``kernel_table``."""
import functools
import importlib.util

from glm5_core import platform
from glm5_core.backends.cuda.device import gpu_probe
from glm5_core.backends.rocm.device import DEVICE
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def aiter_available() -> bool:
    """``aiter`` is installed (found, not imported: importing it initialises HIP)."""
    return importlib.util.find_spec("aiter") is not None


def kernel_table() -> dict[str, Kernel]:
    """The shared Triton kernels with AMD launch configs; aiter's operators where aiter is installed
    (not under the Triton interpreter: aiter needs a GPU)."""
    from glm5_core.backends.rocm.launch import ROCM_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    table = build_kernel_table(ROCM_CONFIGS)
    if aiter_available() and not platform.triton_interpreter_enabled():
        from glm5_core.backends.rocm.aiter_ops import aiter_kernels

        table.update(aiter_kernels(ROCM_CONFIGS))
    return table


BACKEND = triton_backend("rocm", DEVICE, functools.partial(gpu_probe, "rocm"), kernel_table, priority=20,
                         description="AMD GPUs (ROCm torch): Triton kernels with AMD tuning, aiter where installed")
