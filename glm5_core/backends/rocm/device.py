"""The ``rocm`` backend's device facts: AMD GPUs, which ROCm builds of torch drive through the ``cuda`` device
type and ``torch.cuda`` (so the count, the bf16 query and the NCCL group, RCCL underneath, are the cuda
backend's); the visible-devices variable is HIP's (ROCm torch reads ``HIP_VISIBLE_DEVICES`` first, as vLLM's
ROCm platform sets it)."""
from __future__ import annotations

import dataclasses

from glm5_core.backends.cuda.device import DEVICE as CUDA_DEVICE
from glm5_core.backends.cuda.device import is_rocm_build

DEVICE = dataclasses.replace(
    CUDA_DEVICE,
    visible_devices_env="HIP_VISIBLE_DEVICES",
    this_torch=is_rocm_build,
)
