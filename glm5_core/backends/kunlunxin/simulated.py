"""Kunlunxin's torch stack, simulated (``glm5_core.backends.simulated``): a build reporting ``torch.version.cuda``
whose ``torch.cuda`` sees P800s (96 GB each, Kunlunxin's product page), and ``xpu-smi`` listing them. The tool's
output here is illustrative (no capture of a real one was at hand: docs/vendors/kunlunxin.md); detection reads only
that it names a Kunlunxin product."""
from glm5_core.backends.simulated import GIB, SimulatedStack

STACK = SimulatedStack(
    device_type="cuda",
    device_name="Kunlunxin P800",
    device_count=8,
    total_memory=96 * GIB,
    version_attrs={"cuda": "11.8", "hip": None},
    tools={"xpu-smi": "xpu-smi (illustrative)\nDevice 0: P800\n"},
    source="FlagGems src/flag_gems/runtime/backend/_kunlunxin (device_query_cmd xpu-smi)",
)
