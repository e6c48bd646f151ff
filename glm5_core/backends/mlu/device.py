"""The ``mlu`` backend's device facts: Cambricon MLUs through torch_mlu, which registers torch's ``mlu`` device type
(PrivateUse1), and its probe. torch_mlu is imported by the probe only, never at import time.

Sources (docs/vendors/mlu.md): torch_mlu (device type ``mlu``, the ``cncl`` process group, ``MLU_VISIBLE_DEVICES``),
FlagGems' Cambricon backend (``cnmon``; no fp64: its ``UNSUPPORT_FP64`` list)."""
from __future__ import annotations

import functools

import torch

from glm5_core.backends import vendor_stack
from glm5_core.device_facts import COMMON_DTYPES, DeviceFacts

MODULE = "torch_mlu"
DEVICE_TYPE = "mlu"
VISIBLE = "MLU_VISIBLE_DEVICES"
INSTALL = "Cambricon's wheel, not on PyPI: docs/vendors/mlu.md"


@functools.cache
def probe() -> vendor_stack.Probe:
    """torch_mlu found, imported once, ``torch.mlu.is_available()`` (cached)."""
    return vendor_stack.extension_probe(MODULE, DEVICE_TYPE, VISIBLE, INSTALL)


DEVICE = DeviceFacts(
    device_type=DEVICE_TYPE,
    dist_backend="cncl",
    visible_devices_env=VISIBLE,
    ray_resource="MLU",  # a custom Ray resource: start Ray with --resources '{"MLU": <devices>}'
    dtypes=COMMON_DTYPES - {torch.float64},  # no fp64 (FlagGems: UNSUPPORT_FP64 includes CAMBRICON)
    count=functools.partial(vendor_stack.extension_count, MODULE, DEVICE_TYPE),
)
