"""Kunlunxin launch configurations for the shared Triton kernels (Kunlunxin's Triton, FlagGems' ``xpu`` extras).

On-chip memory: Kunlunxin does not publish a per-block shared / local memory figure we could cite for the P800
(docs/vendors/kunlunxin.md). This table holds every launch to 64 KiB at GLM-5's dims by
``glm5_core.backends.triton.shared_memory``'s estimate (tests/backends/triton/test_shared_memory.py), the smallest
limit of the verified vendors, so it fits a device whose limit is at least that. ``num_warps`` 4: the value
FlagGems' Kunlunxin tuning table (its ``tune_configs.yaml``) uses most; the warp width is not published.
"""
from glm5_core.backends.triton.launch import KernelConfigs, tiles_64kib

KUNLUNXIN_CONFIGS = KernelConfigs(vendor="kunlunxin", shared_memory_limit=64 * 1024, overrides=tiles_64kib(num_warps=4))
