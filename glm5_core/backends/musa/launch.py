"""Moore Threads launch configurations for the shared Triton kernels (Triton for MUSA).

Shared memory: 64 KiB per block is the budget of this table: every launch fits it at GLM-5's dims by
``glm5_core.backends.triton.shared_memory``'s estimate (tests/backends/triton/test_shared_memory.py). Moore Threads
does not publish a per-block limit we could cite for the MTT S4000 (docs/vendors/musa.md says so); 64 KiB is the
smallest limit of the verified vendors (AMD gfx942, MetaX C500), so a larger device fits these tiles too.
Warps: ``num_warps`` 4, the value FlagGems' Moore Threads tuning table (its ``tune_configs.yaml``) uses with 8 and 16;
the warp width of MUSA GPUs is not published where we could cite it (docs/vendors/musa.md), so no width is assumed:
4 warps stay within a 1024-thread block at any width up to 256 lanes. The tiles are the 64 KiB tiles (a key block
of 64 for the indexer, as every vendor: the same keys for the same scores).
"""
from glm5_core.backends.triton.launch import KernelConfigs, tiles_64kib

MUSA_CONFIGS = KernelConfigs(vendor="musa", shared_memory_limit=64 * 1024, overrides=tiles_64kib(num_warps=4))
