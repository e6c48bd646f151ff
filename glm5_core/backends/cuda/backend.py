"""Declaration of the ``cuda`` backend. Import-light: triton is imported only by ``kernel_table``."""
import functools
from typing import Dict

from glm5_core import platform
from glm5_core.registry import Backend, Kernel


def kernel_table() -> Dict[str, Kernel]:
    """Triton kernels with NVIDIA launch configs (triton is imported here, not at import time)."""
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    return build_kernel_table(CUDA_CONFIGS)


# Ops left to the reference, and why (shown by `glm5 backends`).
MISSING = {
    "mla_prefill": "dense MLA prefill is left to torch (SDPA-class kernels); DSA's sparse path is the cuda kernel",
    "dsa_sparse_prefill_expanded": "no Triton kernel for the expanded (per-head keys) sparse prefill yet: the "
                                   "reference runs; dsa_sparse_prefill (absorbed) is the Triton kernel",
    "dsa_selected_index_scores": "no Triton kernel for the indexer scores at the selected keys yet: the "
                                 "reference (gathers over the K selected keys, no [T, S] tensor) runs",
}


BACKEND = Backend(
    name="cuda",
    device_type="cuda",
    dist_backend="nccl",
    probe=functools.partial(platform.triton_backend_probe, "cuda"),
    kernel_table=kernel_table,
    missing=MISSING,
    runtime_device=platform.triton_runtime_device,
    description="NVIDIA GPUs: Triton kernels with NVIDIA launch configs",
    detect=lambda: platform.gpu_probe("cuda")[0],
    priority=10,
)
