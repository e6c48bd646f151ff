"""Cambricon launch configurations for the shared Triton kernels (Triton for MLU).

On-chip memory: an MLU core stages a kernel's tiles in its NRAM, whose size Triton for MLU reports at run time
(``max_nram_size``, read so by FlagGems' Cambricon backend): several hundred KiB a core by Cambricon's mlu-ops
(``MAX_NRAM_SIZE``); how Triton for MLU maps a block onto it is not published (docs/vendors/mlu.md). This table
holds every launch to 64 KiB at GLM-5's dims by ``glm5_core.backends.triton.shared_memory``'s estimate
(tests/backends/triton/test_shared_memory.py), the smallest limit of the verified vendors, so it fits a core whose
NRAM is at least that.
``num_warps``: 1, the value FlagGems' Cambricon tuning table (its ``tune_configs.yaml``) uses most (65 of its
explicit entries; 48 are 4); a warp is no documented hardware unit of an MLU core.
"""
from glm5_core.backends.triton.launch import KernelConfigs, tiles_64kib

MLU_CONFIGS = KernelConfigs(vendor="mlu", shared_memory_limit=64 * 1024, overrides=tiles_64kib(num_warps=1))
