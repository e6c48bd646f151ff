"""Kunlunxin launch configurations for the shared Triton kernels (Kunlunxin's Triton, FlagGems' ``xpu`` extras).

On-chip memory: Triton for XPU (FlagTree's ``xpu`` backend) reports no shared memory per block: it stages tiles in
each core's local memory, sized by its own compiler, and no per-core figure for the P800 is published that we could
cite (docs/vendors/kunlunxin.md). This table holds every launch to 64 KiB at GLM-5's dims by
``glm5_core.backends.triton.shared_memory``'s estimate (tests/backends/triton/test_shared_memory.py), the budget of
the other 64 KiB vendors. ``num_warps`` 4: the value FlagGems' Kunlunxin tuning table (its ``tune_configs.yaml``)
uses most; Triton for XPU ignores ``num_warps`` (it logs any value as invalid for the xpu arch).
"""
from glm5_core.backends.triton.launch import KernelConfigs, tiles_64kib

KUNLUNXIN_CONFIGS = KernelConfigs(vendor="kunlunxin", shared_memory_limit=64 * 1024, overrides=tiles_64kib(num_warps=4))
