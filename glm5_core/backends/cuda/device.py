"""The ``cuda`` backend's device facts (NVIDIA GPUs through torch's ``cuda`` device type) and the GPU probe it
shares with ``rocm`` (ROCm builds of torch drive AMD GPUs through the same ``torch.cuda`` interface)."""
from __future__ import annotations

import datetime
import functools

import torch

from glm5_core.device_facts import DeviceFacts

Probe = tuple[bool, str]


def is_rocm_build() -> bool:
    """ROCm builds of torch report device type ``cuda``; only ``torch.version.hip`` tells them apart."""
    return getattr(torch.version, "hip", None) is not None


@functools.cache
def gpu_probe(vendor: str) -> Probe:
    """Probe an NVIDIA (``vendor='cuda'``) or AMD (``vendor='rocm'``) GPU through torch (cached)."""
    if vendor not in ("cuda", "rocm"):
        raise ValueError(f"vendor: expected 'cuda' or 'rocm', got {vendor!r}")
    rocm = is_rocm_build()
    if vendor == "cuda" and rocm:
        return False, f"this torch is a ROCm build (hip {torch.version.hip}); use the rocm backend"
    if vendor == "rocm" and not rocm:
        return False, "this torch is not a ROCm build (torch.version.hip is None)"
    if vendor == "cuda" and torch.version.cuda is None:
        return False, "this torch is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False (no GPU visible to this process)"
    name = torch.cuda.get_device_name(0)
    return True, f"{torch.cuda.device_count()} x {name}"


def gpu_count() -> int:
    """GPUs torch sees (``torch.cuda``: NVIDIA, or AMD on a ROCm build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def native_bf16_gemm(device: torch.device) -> bool:
    return bool(torch.cuda.is_bf16_supported(including_emulation=False))


def nccl_process_group(store, rank: int, world_size: int, timeout: datetime.timedelta, device_host: str):
    """An NCCL group (RCCL on a ROCm build, under the same name)."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise ValueError("backend: 'nccl' needs a torch built with NCCL")
    return dist.ProcessGroupNCCL(store, rank, world_size)


DEVICE = DeviceFacts(
    device_type="cuda",
    dist_backend="nccl",
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    ray_resource="GPU",
    count=gpu_count,
    native_bf16_gemm=native_bf16_gemm,
    process_group=nccl_process_group,
    this_torch=lambda: not is_rocm_build(),
)
