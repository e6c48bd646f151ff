"""The ``hygon`` backend's device facts and probe: Hygon DCUs through the DTK (DCU Toolkit) torch build, a HIP build
(``torch.version.hip`` set, as on AMD) that presents them as ``cuda`` (FlagGems' Hygon backend: ``device_name=
"cuda"``, Triton's ``hip`` extras).

Told apart from AMD's ROCm builds by Hygon's markers only: the build string (Hygon publishes
``torch-2.4.1+das.opt2.dtk2504`` and the like: ``dtk``) or its SMI tool ``hy-smi`` (FlagGems' ``device_query_cmd``).
Collectives: DTK's RCCL, through torch's ``nccl`` name, as on AMD. Sources: docs/vendors/hygon.md."""
from __future__ import annotations

import dataclasses
import functools

from glm5_core.backends import vendor_stack
from glm5_core.backends.cuda.device import DEVICE as CUDA_DEVICE

TOOL = "hy-smi"
BUILD_MARKERS = ("dtk",)


@functools.cache
def probe() -> vendor_stack.Probe:
    return vendor_stack.presenting_probe(label="Hygon DCU", device_type="cuda", version_attr="hip", tool=TOOL,
                                         build_markers=BUILD_MARKERS)


def this_torch() -> bool:
    return vendor_stack.presenting_build(version_attr="hip", tool=TOOL, build_markers=BUILD_MARKERS, probe=probe)


DEVICE = dataclasses.replace(
    CUDA_DEVICE,  # cuda, "nccl" (DTK's RCCL), fp64 included
    visible_devices_env="HIP_VISIBLE_DEVICES",
    this_torch=this_torch,
)
