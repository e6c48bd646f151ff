"""The ``kunlunxin`` backend's device facts and probe: Kunlunxin XPUs (P800, R300, R200) driven through a torch
build that presents them as ``cuda`` (FlagGems' Kunlunxin backend: ``device_name="cuda"``).

Told apart from NVIDIA (and from AMD, whose builds report ``torch.version.hip``) by Kunlunxin's marker only: its SMI
tool ``xpu-smi`` (FlagGems' ``device_query_cmd``) runs and lists a Kunlunxin device. Intel ships a tool of the same
name for its GPUs, so exit status alone is no marker here: the output must name a Kunlunxin product. Sources:
docs/vendors/kunlunxin.md."""
from __future__ import annotations

import dataclasses
import functools

import torch

from glm5_core.backends import vendor_stack
from glm5_core.backends.cuda.device import DEVICE as CUDA_DEVICE
from glm5_core.device_facts import COMMON_DTYPES

TOOL = "xpu-smi"
TOOL_WORDS = ("kunlun", "P800", "R300", "R200")


@functools.cache
def probe() -> vendor_stack.Probe:
    return vendor_stack.presenting_probe(label="Kunlunxin", device_type="cuda", version_attr="cuda", tool=TOOL,
                                         tool_words=TOOL_WORDS)


def this_torch() -> bool:
    return vendor_stack.presenting_build(version_attr="cuda", tool=TOOL, probe=probe)


DEVICE = dataclasses.replace(
    CUDA_DEVICE,  # the device type, count, bf16 query and "nccl" group (Kunlunxin's collectives underneath)
    visible_devices_env="XPU_VISIBLE_DEVICES",
    ray_resource="KUNLUNXIN",  # Ray has no Kunlunxin accelerator: start Ray with --resources '{"KUNLUNXIN": n}'
    dtypes=COMMON_DTYPES - {torch.float64},  # no fp64 (FlagGems: UNSUPPORT_FP64 includes KUNLUNXIN)
    this_torch=this_torch,
)
