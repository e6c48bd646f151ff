"""Moore Threads launch configurations for the shared Triton kernels (Triton for MUSA).

Shared memory: 64 KiB per block is the budget of this table: every launch fits it at GLM-5's dims by
``glm5_core.backends.triton.shared_memory``'s estimate (tests/backends/triton/test_shared_memory.py). FlagTree's
Triton for MUSA refuses a kernel over 73,728 bytes on an MTT S4000 (196,608 on an S5000), so the table fits both;
llama.cpp reports 28 KiB per block for CUDA-source kernels on the same archs, a conflict docs/vendors/musa.md cites
and that only a run on the device settles. Warps: ``num_warps`` 4, the value FlagGems' Moore Threads tuning table
(its ``tune_configs.yaml``) uses with 8 and 16; Triton for MUSA's default warp is 32 lanes: 128 threads a block.
The tiles are the 64 KiB tiles (a key block of 64 for the indexer, as every vendor: the same keys for the same
scores).
"""
from glm5_core.backends.triton.launch import KernelConfigs, tiles_64kib

MUSA_CONFIGS = KernelConfigs(vendor="musa", shared_memory_limit=64 * 1024, overrides=tiles_64kib(num_warps=4))
