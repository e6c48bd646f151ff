"""NVIDIA launch configurations for the shared Triton kernels (``glm5_core.backends.triton``).

The kernel modules' defaults (each module's ``DEFAULT_LAUNCH``) are the Hopper-class launches (32-lane warps), so
this table overrides none of them. Shared memory: Hopper (H100 / H200) has 228 KiB per SM, of which one block can
opt into 227 KiB (NVIDIA calls it SMEM; an operand of a tl.dot is staged there for ldmatrix / wgmma). Every launch
at GLM-5's dims fits it by ``glm5_core.backends.triton.shared_memory``'s estimate
(tests/backends/triton/test_shared_memory.py); the largest, the fp32 sparse-MLA backward, needs 220 KiB.
"""
from glm5_core.backends.triton.launch import KernelConfigs

CUDA_CONFIGS = KernelConfigs(vendor="cuda", shared_memory_limit=227 * 1024)  # bytes per block (opt-in)
