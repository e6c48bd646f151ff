"""Declaration of the ``cpu`` backend: always available; native kernels where the extension builds."""
from typing import Callable, Dict

from glm5_core.registry import Backend


def kernel_table() -> Dict[str, Callable]:
    return {}


BACKEND = Backend(
    name="cpu",
    device_type="cpu",
    dist_backend="gloo",
    probe=lambda: (True, "always available"),
    kernel_table=kernel_table,
    description="CPU: C++/OpenMP kernels from csrc/ (built on first use), pure-torch reference elsewhere",
)
