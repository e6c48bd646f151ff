"""Declaration of the ``kunlunxin`` backend. Import-light: the probe reads the torch build and runs the
vendor's SMI tool once; triton is imported by ``kernel_table``."""
from glm5_core.backends.kunlunxin.device import DEVICE, probe
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def kernel_table() -> dict[str, Kernel]:
    """The shared Triton kernels with the kunlunxin launch table."""
    from glm5_core.backends.kunlunxin.launch import KUNLUNXIN_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(KUNLUNXIN_CONFIGS)


# above cuda (10) and rocm (20): on this vendor's stack (its marker found) it is detected first
BACKEND = triton_backend("kunlunxin", DEVICE, probe, kernel_table, priority=22, interpreted_without_device=False,
                         description="Kunlunxin XPUs (cuda-presenting torch): Triton kernels, Kunlunxin launch configs")
