"""Declaration of the ``hygon`` backend. Import-light: the probe reads the torch build and runs the
vendor's SMI tool once; triton is imported by ``kernel_table``."""
from glm5_core.backends.hygon.device import DEVICE, probe
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def kernel_table() -> dict[str, Kernel]:
    """The shared Triton kernels with the hygon launch table."""
    from glm5_core.backends.hygon.launch import HYGON_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(HYGON_CONFIGS)


# above cuda (10) and rocm (20): on this vendor's stack (its marker found) it is detected first
BACKEND = triton_backend("hygon", DEVICE, probe, kernel_table, priority=21, interpreted_without_device=False,
                         description="Hygon DCUs (DTK torch, HIP): Triton kernels with Hygon launch configs")
