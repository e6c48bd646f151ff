"""Declaration of the ``musa`` backend. Import-light: torch_musa is imported by the probe, triton by
``kernel_table``."""
from glm5_core.backends.musa.device import DEVICE, probe
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def kernel_table() -> dict[str, Kernel]:
    """The shared Triton kernels with the Moore Threads launch table."""
    from glm5_core.backends.musa.launch import MUSA_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(MUSA_CONFIGS)


BACKEND = triton_backend("musa", DEVICE, probe, kernel_table, priority=31, interpreted_without_device=False,
                         description="Moore Threads GPUs (torch_musa): Triton kernels with MUSA launch configs")
