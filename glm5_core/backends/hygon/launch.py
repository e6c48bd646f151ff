"""Hygon launch configurations for the shared Triton kernels (DTK's Triton, the HIP backend).

A Hygon DCU is a GCN-derived HIP device (gfx9 targets): a wavefront is 64 lanes (so ``num_warps`` stays <= 16: 1024
lanes) and a workgroup has 64 KiB of LDS (HIP's shared memory), as FlagTree's Triton for Hygon DCUs (its ``hcu``
backend) sets both (docs/vendors/hygon.md). Every launch fits
64 KiB at GLM-5's dims by ``glm5_core.backends.triton.shared_memory``'s estimate
(tests/backends/triton/test_shared_memory.py). AMD-only compiler knobs (``waves_per_eu``) are not passed: DTK's
Triton is not documented to take them. ``num_warps`` 4: the value FlagGems' Hygon tuning table uses most.
"""
from glm5_core.backends.triton.launch import KernelConfigs, tiles_64kib

WARP_SIZE = 64
MAX_NUM_WARPS = 16

HYGON_CONFIGS = KernelConfigs(vendor="hygon", shared_memory_limit=64 * 1024, overrides=tiles_64kib(num_warps=4))
