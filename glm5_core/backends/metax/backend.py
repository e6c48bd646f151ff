"""Declaration of the ``metax`` backend. Import-light: the probe reads the torch build and runs the
vendor's SMI tool once; triton is imported by ``kernel_table``."""
from glm5_core.backends.metax.device import DEVICE, probe
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def kernel_table() -> dict[str, Kernel]:
    """The shared Triton kernels with the metax launch table."""
    from glm5_core.backends.metax.launch import METAX_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(METAX_CONFIGS)


# above cuda (10) and rocm (20): on this vendor's stack (its marker found) it is detected first
BACKEND = triton_backend("metax", DEVICE, probe, kernel_table, priority=23, interpreted_without_device=False,
                         description="MetaX GPUs (torch +metax): Triton kernels with MetaX launch configs")
