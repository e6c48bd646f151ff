"""Declaration of the ``cuda`` backend. Import-light: triton is imported only by ``kernel_table``."""
import functools
from typing import Dict

from glm5_core import platform
from glm5_core.backends.cuda.device import DEVICE, gpu_probe
from glm5_core.backends.triton.table import MISSING
from glm5_core.registry import Backend, Kernel


def kernel_table() -> Dict[str, Kernel]:
    """Triton kernels with NVIDIA launch configs (triton is imported here, not at import time)."""
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(CUDA_CONFIGS)


BACKEND = Backend(
    name="cuda",
    facts=DEVICE,
    probe=functools.partial(platform.triton_backend_probe, functools.partial(gpu_probe, "cuda")),
    kernel_table=kernel_table,
    missing=MISSING,  # shared by every Triton vendor
    runtime_device=functools.partial(platform.triton_runtime_device, DEVICE.device_type),
    description="NVIDIA GPUs: Triton kernels with NVIDIA launch configs",
    detect=lambda: gpu_probe("cuda")[0],
    priority=10,
)
