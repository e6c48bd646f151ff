"""The ``musa`` backend's device facts: Moore Threads GPUs through torch_musa, which registers torch's ``musa``
device type (PrivateUse1), and its probe. torch_musa is imported by the probe only, never at import time.

Sources (docs/vendors/musa.md): torch_musa (device type ``musa``, ``MUSA_VISIBLE_DEVICES``, the ``mccl`` process
group), FlagGems' Moore Threads backend (``mthreads-gmi``; no fp64: its ``UNSUPPORT_FP64`` list)."""
from __future__ import annotations

import functools

import torch

from glm5_core.backends import vendor_stack
from glm5_core.device_facts import COMMON_DTYPES, DeviceFacts

MODULE = "torch_musa"
DEVICE_TYPE = "musa"
VISIBLE = "MUSA_VISIBLE_DEVICES"
INSTALL = "Moore Threads's wheel, not on PyPI: docs/vendors/musa.md"


@functools.cache
def probe() -> vendor_stack.Probe:
    """torch_musa found, imported once, ``torch.musa.is_available()`` (cached)."""
    return vendor_stack.extension_probe(MODULE, DEVICE_TYPE, VISIBLE, INSTALL)


DEVICE = DeviceFacts(
    device_type=DEVICE_TYPE,
    dist_backend="mccl",
    visible_devices_env=VISIBLE,
    ray_resource="MUSA",  # a custom Ray resource: start Ray with --resources '{"MUSA": <devices>}'
    dtypes=COMMON_DTYPES - {torch.float64},  # no fp64 (FlagGems: UNSUPPORT_FP64 includes MTHREADS)
    count=functools.partial(vendor_stack.extension_count, MODULE, DEVICE_TYPE),
)
