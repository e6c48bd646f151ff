"""MetaX launch configurations for the shared Triton kernels (MetaX's Triton / FlagTree for MACA).

Shared memory: 64 KiB per block (65,536 bytes: a C500 refuses a FlagGems launch needing 73,728 bytes at compile
time, and its device properties report 64 KiB; docs/vendors/metax.md). Every launch fits it at GLM-5's dims by
``glm5_core.backends.triton.shared_memory``'s estimate (tests/backends/triton/test_shared_memory.py): the same
tiles as the other 64 KiB vendors (a key block of 64 for the indexer, as every vendor). ``num_warps`` 4: the value
FlagGems' MetaX tuning table (its ``tune_configs.yaml``) uses most.
"""
from glm5_core.backends.triton.launch import KernelConfigs, tiles_64kib

METAX_CONFIGS = KernelConfigs(vendor="metax", shared_memory_limit=64 * 1024, overrides=tiles_64kib(num_warps=4))
