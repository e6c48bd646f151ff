"""The ``cpu`` backend's device facts: the host, on torch's ``gloo`` backend."""
from __future__ import annotations

import datetime

import torch

from glm5_core.device_facts import DeviceFacts


def native_bf16_gemm(device: torch.device) -> bool:
    """CPUs with AVX512-BF16 or AMX (torch's private cpuinfo probes, asked at call time); False where oneDNN
    would emulate bf16 by conversions (slower than fp32)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe is not None and bool(probe()) for probe in probes)


def gloo_process_group(store, rank: int, world_size: int, timeout: datetime.timedelta, device_host: str):
    """A gloo group on CPU tensors whose transport binds ``device_host`` (the default device when empty)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host) if device_host
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


DEVICE = DeviceFacts(
    device_type="cpu",
    dist_backend="gloo",
    native_bf16_gemm=native_bf16_gemm,
    process_group=gloo_process_group,
)
