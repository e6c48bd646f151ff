"""The documented surface of torch_gcu, simulated (``glm5_core.backends.simulated``): ``import torch_gcu``
registers ``torch.gcu`` with ``is_available``, ``device_count``, ``get_device_name`` and ``get_device_properties``
(torch_gcu's CUDA-like device API); an Enflame S60 has 48 GB (Enflame's product page). docs/vendors/gcu.md."""
from glm5_core.backends.simulated import GIB, SimulatedStack

STACK = SimulatedStack(
    device_type="gcu",
    module="torch_gcu",
    device_name="Enflame S60",
    device_count=8,
    total_memory=48 * GIB,
    source="Enflame TopsRider torch_gcu",
)
