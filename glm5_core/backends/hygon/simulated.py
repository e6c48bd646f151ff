"""Hygon's DTK torch stack, simulated (``glm5_core.backends.simulated``): the build string Hygon publishes
(``2.4.1+das.opt2.dtk2504``), ``torch.version.hip`` set (a HIP build), ``torch.cuda`` seeing K100-AI DCUs (64 GB
each), and ``hy-smi`` present (its output is illustrative: detection reads its exit status). docs/vendors/hygon.md."""
from glm5_core.backends.simulated import GIB, SimulatedStack

STACK = SimulatedStack(
    device_type="cuda",
    device_name="K100_AI",
    device_count=8,
    total_memory=64 * GIB,
    torch_version="2.4.1+das.opt2.dtk2504",
    version_attrs={"cuda": None, "hip": "6.2.41134"},
    tools={"hy-smi": "hy-smi (illustrative)\nDCU 0 K100_AI\n"},
    source="https://download.sourcefind.cn:65024/file/4/pytorch/DAS1.5/",
)
