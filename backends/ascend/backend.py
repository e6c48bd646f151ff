"""Declaration of the ``ascend`` backend. Import-light: torch_npu is imported only by the probe."""
from typing import Callable, Dict

from glm5_core import platform
from glm5_core.registry import Backend


def kernel_table() -> Dict[str, Callable]:
    return {}


BACKEND = Backend(
    name="ascend",
    device_type="npu",
    dist_backend="hccl",
    probe=platform.npu_probe,
    kernel_table=kernel_table,
    description="Huawei Ascend NPUs: torch_npu operators",
)
