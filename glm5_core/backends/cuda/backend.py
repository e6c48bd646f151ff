"""Declaration of the ``cuda`` backend. Import-light: triton is imported only by ``kernel_table``."""
import functools

from glm5_core.backends.cuda.device import DEVICE, gpu_probe
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def kernel_table() -> dict[str, Kernel]:
    """Triton kernels with NVIDIA launch configs (triton is imported here, not at import time)."""
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(CUDA_CONFIGS)


_EP_REFERENCE = ("the reference (all_to_all_single over NCCL) runs, with or without deep_ep: DeepEP's ElasticBuffer "
                 "(deep_ep 2.1.0) is not wired in yet; its expand-mode dispatch layout is mapped in "
                 "backends/cuda/ep_layouts.py (docs/expert-parallel-vendors.md)")
MISSING = {"ep_dispatch": _EP_REFERENCE, "ep_combine": _EP_REFERENCE}

BACKEND = triton_backend("cuda", DEVICE, functools.partial(gpu_probe, "cuda"), kernel_table, priority=10,
                         description="NVIDIA GPUs: Triton kernels with NVIDIA launch configs", missing=MISSING)
