"""MetaX's torch stack, simulated (``glm5_core.backends.simulated``): the build string MetaX publishes
(``2.8.0+metax3.7.1.3``), ``torch.version.cuda`` set, ``torch.cuda`` seeing C500s (64 GB each), and ``mx-smi``
present (its output is illustrative: detection reads its exit status). docs/vendors/metax.md."""
from glm5_core.backends.simulated import GIB, SimulatedStack

STACK = SimulatedStack(
    device_type="cuda",
    device_name="MetaX C500",
    device_count=8,
    total_memory=64 * GIB,
    torch_version="2.8.0+metax3.7.1.3",
    version_attrs={"cuda": "12.8", "hip": None},
    tools={"mx-smi": "mx-smi (illustrative)\nMetaX C500\n"},
    source="https://repos.metax-tech.com/r/maca-pypi/packages/torch/",
)
