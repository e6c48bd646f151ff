"""The documented surface of torch_musa, simulated (``glm5_core.backends.simulated``): ``import torch_musa``
registers ``torch.musa`` with ``is_available``, ``device_count``, ``get_device_name`` and ``get_device_properties``
(torch_musa's README); an MTT S4000 has 48 GB (Moore Threads' product page). docs/vendors/musa.md."""
from glm5_core.backends.simulated import GIB, SimulatedStack

STACK = SimulatedStack(
    device_type="musa",
    module="torch_musa",
    device_name="MTT S4000",
    device_count=8,
    total_memory=48 * GIB,
    source="https://github.com/MooreThreads/torch_musa",
)
