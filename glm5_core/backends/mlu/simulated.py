"""The documented surface of torch_mlu, simulated (``glm5_core.backends.simulated``): ``import torch_mlu``
registers ``torch.mlu`` with ``is_available``, ``device_count``, ``get_device_name`` and ``get_device_properties``
(torch_mlu's sources); an MLU370-X8 has 48 GB (Cambricon's product page). docs/vendors/mlu.md."""
from glm5_core.backends.simulated import GIB, SimulatedStack

STACK = SimulatedStack(
    device_type="mlu",
    module="torch_mlu",
    device_name="MLU370-X8",
    device_count=8,
    total_memory=48 * GIB,
    source="https://github.com/Cambricon/torch_mlu",
)
