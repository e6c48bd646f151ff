"""The ``ascend`` backend's device facts (Huawei Ascend NPUs through torch_npu's ``npu`` device type) and its
probe. torch_npu is imported by the probe only, never at import time."""
from __future__ import annotations

import datetime
import functools
import importlib
import importlib.util
import os
import sys

import torch

from glm5_core.device_facts import COMMON_DTYPES, DeviceFacts

Probe = tuple[bool, str]


@functools.cache
def npu_probe() -> Probe:
    """Ascend NPU: find torch_npu, import it once, then ask ``torch.npu.is_available()`` (cached).

    Since torch 2.5 torch_npu may already be loaded by ``import torch`` (device-backend autoload);
    in that case it is not imported again.
    """
    if not hasattr(torch, "npu"):
        if importlib.util.find_spec("torch_npu") is None:
            return False, "torch_npu is not installed (pip install 'glm5-core[ascend]')"
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:
            return False, f"torch_npu failed to import: {exc!r}"
    try:
        if not torch.npu.is_available():
            return False, "torch.npu.is_available() is False (check ASCEND_RT_VISIBLE_DEVICES and the CANN driver)"
        count = torch.npu.device_count()
    except Exception as exc:
        return False, f"torch.npu query failed: {exc!r}"
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    suffix = f" (ASCEND_RT_VISIBLE_DEVICES={visible})" if visible else ""
    return True, f"{count} Ascend NPU(s){suffix}"


def npu_count() -> int:
    """NPUs torch sees, only when torch_npu is already imported (counting never imports it)."""
    npu = getattr(torch, "npu", None) if "torch_npu" in sys.modules else None
    return npu.device_count() if npu is not None and npu.is_available() else 0


# SoC names (torch.npu.get_device_name) whose cube units compute bf16 natively: Atlas A2 (Ascend910B1..B4) and
# A3 (Ascend910_93xx) training series; the first-generation Ascend910A / 910ProB and the 310 inference chips do not
BF16_SOC_PREFIXES = ("Ascend910B", "Ascend910_93")


def native_bf16_gemm(device: torch.device) -> bool:
    """Whether ``device``'s NPU multiplies bf16 natively (its SoC name), asked only when torch_npu is already
    imported (never importing it): Muon's ``ns_dtype: auto`` picks bf16 there."""
    npu = getattr(torch, "npu", None) if "torch_npu" in sys.modules else None
    if npu is None or not npu.is_available():
        return False
    name = npu.get_device_name(device.index if device.index is not None else npu.current_device())
    return str(name).startswith(BF16_SOC_PREFIXES)


def hccl_process_group(store, rank: int, world_size: int, timeout: datetime.timedelta, device_host: str):
    try:
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # imported on request only
    except ImportError:
        raise ValueError("backend: 'hccl' needs torch_npu") from None
    return ProcessGroupHCCL(store, rank, world_size)


DEVICE = DeviceFacts(
    device_type="npu",
    dist_backend="hccl",
    visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
    ray_resource="NPU",  # the resource name Ray gives Ascend NPUs
    # fp64 is no dtype of the NPU's AI cores (torch_npu runs float64 on few ops, on the AI CPU)
    dtypes=COMMON_DTYPES - {torch.float64},
    count=npu_count,
    native_bf16_gemm=native_bf16_gemm,
    process_group=hccl_process_group,
)
