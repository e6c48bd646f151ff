"""The ``metax`` backend's device facts and probe: MetaX GPUs through MetaX's MACA torch build, which presents them
as ``cuda`` (FlagGems' MetaX backend: ``device_name="cuda"``; Ray's MetaX accelerator manager: resource ``GPU``,
``CUDA_VISIBLE_DEVICES``).

Told apart from NVIDIA by MetaX's markers only: the torch build string (MetaX publishes ``torch-2.8.0+metax3.7.1.3``
and the like on its package index) or its SMI tool ``mx-smi`` (FlagGems' ``device_query_cmd``). Sources:
docs/vendors/metax.md."""
from __future__ import annotations

import dataclasses
import functools

from glm5_core.backends import vendor_stack
from glm5_core.backends.cuda.device import DEVICE as CUDA_DEVICE

TOOL = "mx-smi"
BUILD_MARKERS = ("metax",)


@functools.cache
def probe() -> vendor_stack.Probe:
    return vendor_stack.presenting_probe(label="MetaX", device_type="cuda", version_attr="cuda", tool=TOOL,
                                         build_markers=BUILD_MARKERS)


def this_torch() -> bool:
    return vendor_stack.presenting_build(version_attr="cuda", tool=TOOL, build_markers=BUILD_MARKERS, probe=probe)


DEVICE = dataclasses.replace(
    CUDA_DEVICE,  # cuda, "nccl" (MetaX's MCCL underneath), CUDA_VISIBLE_DEVICES, Ray's GPU, fp64 included
    this_torch=this_torch,
)
