"""Declaration of the ``cuda`` backend. Import-light: triton is imported only by ``kernel_table``."""
import functools

from glm5_core.backends.cuda.device import DEVICE, gpu_probe
from glm5_core.backends.triton.vendor import triton_backend
from glm5_core.registry import Kernel


def kernel_table() -> dict[str, Kernel]:
    """Triton kernels with NVIDIA launch configs (triton is imported here, not at import time), and DeepEP's
    dispatch / combine where ``deep_ep`` is importable (looked up, not imported: backends/cuda/ep.py imports it
    inside its kernels)."""
    from glm5_core.backends.cuda.ep_layouts import deep_ep_importable
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.triton.table import build_kernel_table

    table = build_kernel_table(CUDA_CONFIGS)
    if deep_ep_importable()[0]:
        from glm5_core.backends.cuda import ep

        table.update(ep.KERNELS)
    return table


# shown by `glm5 backends` where deep_ep is not importable (with it, the kernels' per-call declines say why the
# reference runs: no ElasticBuffer in use_buffer, not bf16, a batch over num_max_tokens_per_rank, combine in training)
_EP_REFERENCE = ("deep_ep is not importable: the reference (all_to_all_single over NCCL) runs. With deep_ep (2.1.0, "
                 "ElasticBuffer), backends/cuda/ep.py runs DeepEP's dispatch (bf16, deterministic, bitwise the "
                 "contract) inside use_buffer(...)")
_EP_COMBINE = ("deep_ep is not importable: the reference (all_to_all_single over NCCL) runs. With deep_ep, DeepEP's "
               "combine runs for rollout only (torch.inference_mode): it sums caller-weighted bf16 rows, not the "
               "contract's fp32 slot-order sum, so training keeps the reference")
MISSING = {"ep_dispatch": _EP_REFERENCE, "ep_combine": _EP_COMBINE}

BACKEND = triton_backend("cuda", DEVICE, functools.partial(gpu_probe, "cuda"), kernel_table, priority=10,
                         description="NVIDIA GPUs: Triton kernels with NVIDIA launch configs", missing=MISSING)
