"""What a vendor's devices are, in one object (vLLM's ``Platform`` idea): each vendor folder declares one
:class:`DeviceFacts` in its ``device.py`` and its :class:`~glm5_core.registry.Backend` holds it.

Code outside the vendor folders (RL placement, the weight-update groups, Muon's compute dtype, ``glm5 backends``)
reads these facts, found by device type through :mod:`glm5_core.device_kinds`, and names no vendor: a new vendor
is its folder. Building a ``DeviceFacts`` imports no vendor SDK and probes nothing; its callables are asked at
call time only.
"""
from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

# Tensor dtypes every torch device type holds (a vendor may declare fewer or more).
COMMON_DTYPES: frozenset[torch.dtype] = frozenset({
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
})

# Builds a torch ``ProcessGroup`` of this vendor's distributed backend: (store, rank, world_size, timeout,
# device_host: the host name a transport binds, or "") -> ProcessGroup.
ProcessGroupFactory = Callable[[Any, int, int, datetime.timedelta, str], Any]


def _never(device: torch.device) -> bool:
    return False


def _always() -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """The device facts of one vendor.

    ``device_type``: torch's device type, the prefix of device strings (``<device_type>:<index>``).
    ``dist_backend``: the ``torch.distributed`` backend of these devices.
    ``visible_devices_env``: the environment variable that limits a process to some of these devices (a worker
    placed on device ``i`` is given ``<env>=i`` and uses device 0); None for a host device.
    ``ray_resource``: the Ray resource one device is asked for by (``"GPU"``: Ray's own ``num_gpus``; any other
    name: a custom resource); None for a host device.
    ``dtypes``: the tensor dtypes these devices compute in.
    ``count``: how many devices of this type this process sees, asked at call time, importing no vendor SDK
    that is not already loaded; None for the host device (``cpu``: never counted, no index needed).
    ``native_bf16_gemm``: whether bf16 GEMMs run natively (faster than fp32) on a given device of this type.
    ``process_group``: builds a ``ProcessGroup`` of ``dist_backend`` (see :data:`ProcessGroupFactory`), for the
    weight-update groups; None where the vendor has none.
    ``this_torch``: whether this torch build drives ``device_type`` through this vendor (several vendors may share
    a device type, each with its own torch build); asked at call time, never probing a device.
    """

    device_type: str
    dist_backend: str
    visible_devices_env: Optional[str] = None
    ray_resource: Optional[str] = None
    dtypes: frozenset[torch.dtype] = COMMON_DTYPES
    count: Optional[Callable[[], int]] = None
    native_bf16_gemm: Callable[[torch.device], bool] = _never
    process_group: Optional[ProcessGroupFactory] = None
    this_torch: Callable[[], bool] = _always

    @property
    def is_host(self) -> bool:
        """The host device (``cpu``): not counted, indexed optionally, visible to every process."""
        return self.count is None

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self.dtypes

    def ray_options(self) -> Mapping[str, Any]:
        """The ``.options(...)`` of a Ray actor that uses one of these devices."""
        if self.ray_resource is None:
            return {}
        if self.ray_resource == "GPU":  # Ray's built-in accelerator resource, asked for by num_gpus
            return {"num_gpus": 1}
        return {"resources": {self.ray_resource: 1}}

    def worker_environment(self, index: int) -> Mapping[str, str]:
        """The environment that makes device ``index`` the only one (device 0) a worker process sees."""
        return {} if self.visible_devices_env is None else {self.visible_devices_env: str(index)}


def torch_device_module(device_type: str) -> Any:
    """torch's module for ``device_type`` (``torch.<device_type>``: an accelerator's own, or the module a
    privateuse1 plug-in registers under the name it gives the device: ``torch.utils.rename_privateuse1_backend(name)`` +
    ``torch._register_device_module(name, module)``); None for ``cpu``. ValueError in one line when torch has
    none (a plug-in not imported, or a device type spelt otherwise than the plug-in registers it)."""
    if device_type == "cpu":
        return None
    module = getattr(torch, device_type, None)
    if module is not None:
        return module
    try:  # "privateuseone" itself: the module of the name a plug-in renamed it to
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError, ValueError) as exc:
        renamed = torch._C._get_privateuse1_backend_name()
        hint = (f"; this torch's privateuse1 device is named {renamed!r}: declare device_type={renamed!r}"
                if renamed != "privateuseone" else "; import the vendor's torch plug-in first")
        raise ValueError(f"device_type: torch has no device module for {device_type!r} "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}){hint}") from None
