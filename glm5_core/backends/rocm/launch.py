"""AMD launch configurations for the shared Triton kernels (CDNA3, e.g. MI300X).

A wavefront is 64 lanes, so a "warp" here is twice NVIDIA's: ``num_warps`` stays <= 16 (1024 lanes).
``waves_per_eu`` is the AMD-only occupancy hint (wavefronts per SIMD) passed through to the compiler.
Tile sizes of the indexer are the same as NVIDIA's key block so both backends select bitwise the same
keys for the same scores (only the launch shape differs).
"""
from glm5_core.backends.cuda.launch import CUDA_CONFIGS
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig

MAX_NUM_WARPS = 16

ROCM_CONFIGS = KernelConfigs(vendor="rocm", families={
    "indexer": LaunchConfig(num_warps=4, num_stages=2, blocks=dict(CUDA_CONFIGS["indexer"].blocks),
                            extra={"waves_per_eu": 2}),
    "sparse_mla": LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 16, "keys": 64},
                               extra={"waves_per_eu": 2}),
    "moe_route": LaunchConfig(num_warps=4, num_stages=1, blocks={"tokens": 16}, extra={"waves_per_eu": 0}),
    "moe_permute": LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 512, "cols": 256},
                                extra={"waves_per_eu": 0}),
    "grouped_gemm": LaunchConfig(num_warps=8, num_stages=2, blocks={"m": 64, "n": 128, "k": 64},
                                 extra={"waves_per_eu": 2, "matrix_instr_nonkdim": 16}),
    "newton_schulz": LaunchConfig(num_warps=8, num_stages=2, blocks={"m": 64, "n": 128, "k": 64},
                                  extra={"waves_per_eu": 2, "matrix_instr_nonkdim": 16}),
})

assert all(config.num_warps <= MAX_NUM_WARPS for config in ROCM_CONFIGS.families.values())
