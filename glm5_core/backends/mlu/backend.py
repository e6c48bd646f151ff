"""Declaration of the ``mlu`` backend. Import-light: torch_mlu is imported by the probe, triton by
``kernel_table``."""
from glm5_core.backends.mlu.device import DEVICE, probe
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def kernel_table() -> dict[str, Kernel]:
    """The shared Triton kernels with the Cambricon launch table."""
    from glm5_core.backends.mlu.launch import MLU_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(MLU_CONFIGS)


BACKEND = triton_backend("mlu", DEVICE, probe, kernel_table, priority=32, interpreted_without_device=False,
                         description="Cambricon MLUs (torch_mlu): Triton kernels with MLU launch configs")
