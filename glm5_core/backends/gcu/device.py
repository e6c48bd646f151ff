"""The ``gcu`` backend's device facts: Enflame GCUs through torch_gcu, which registers torch's ``gcu`` device type
(PrivateUse1), and its probe. torch_gcu is imported by the probe only, never at import time.

Sources (docs/vendors/gcu.md): torch_gcu (device type ``gcu``, ``TOPS_VISIBLE_DEVICES``, the ECCL process group),
Enflame's vLLM platform (``device_control_env_var = "TOPS_VISIBLE_DEVICES"``); no int64 on the device (the issue's
requirement, from Enflame's own int32 index path; docs/vendors/gcu.md says what was verified)."""
from __future__ import annotations

import functools

import torch

from glm5_core.backends import vendor_stack
from glm5_core.device_facts import COMMON_DTYPES, DeviceFacts

MODULE = "torch_gcu"
DEVICE_TYPE = "gcu"
VISIBLE = "TOPS_VISIBLE_DEVICES"
INSTALL = "Enflame's wheel, not on PyPI: docs/vendors/gcu.md"


@functools.cache
def probe() -> vendor_stack.Probe:
    """torch_gcu found, imported once, ``torch.gcu.is_available()`` (cached)."""
    return vendor_stack.extension_probe(MODULE, DEVICE_TYPE, VISIBLE, INSTALL)


DEVICE = DeviceFacts(
    device_type=DEVICE_TYPE,
    dist_backend="eccl",
    visible_devices_env=VISIBLE,
    ray_resource="GCU",  # a custom Ray resource: start Ray with --resources '{"GCU": <devices>}'
    dtypes=COMMON_DTYPES - {torch.int64},  # no int64: indices are int32 (the top-k of gcu/dsa.py)
    count=functools.partial(vendor_stack.extension_count, MODULE, DEVICE_TYPE),
)
