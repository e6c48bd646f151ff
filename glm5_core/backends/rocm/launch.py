"""AMD launch configurations for the shared Triton kernels (CDNA3, e.g. MI300X): overrides of every kernel
module's default (its ``DEFAULT_LAUNCH``, sized for NVIDIA's Hopper), so a new kernel module launches here with its
default until it gets a line (which must fit 64 KiB: tests/backends/triton/test_shared_memory.py).

A wavefront is 64 lanes, so a "warp" here is twice NVIDIA's: ``num_warps`` stays <= 16 (1024 lanes).
``waves_per_eu`` is the AMD-only occupancy hint (wavefronts per SIMD) passed through to the compiler.
Tile sizes of the indexer are the default's key block (64) so both backends select bitwise the same
keys for the same scores (only the launch shape differs).

Shared memory: gfx942 gives a workgroup 64 KiB of LDS (AMD's name for a block's shared memory; an operand of a
tl.dot is staged there ahead of the MFMA instructions; NVIDIA's Hopper 227 KiB), so the tiles here are smaller
than NVIDIA's wherever a kernel holds wide fp32 dot operands: every launch at GLM-5's dims fits 64 KiB by
``glm5_core.backends.triton.shared_memory``'s (upper-bound) estimate, checked by
tests/backends/triton/test_shared_memory.py.
  indexer        num_stages 1 (the default's key block): q [32, 128] + keys [64, 128] fp32 + the top-k merge
  sparse_mla     heads 4 x keys 8: the fp32 dkv backward holds q_lat, d_out [4, 512], the keys [8, 512] and
                 its [8, 512] accumulator (the old 16 x 64 needed 128 KiB: the [64, 512] fp32 key rows alone)
  dsa_selected_attention_target
                 sparse_mla's heads 4 x keys 8 (the same fp32 q_lat / latent-row tiles, no accumulator); the
                 causal log-sum-exp's rows 16 x keys 8: q_lat [16, 512] + key rows [8, 512] fp32, ~55 KiB
  moe_experts    64 x 64 x 32, num_stages 1 (AMD's advice for loops of several dots): the SwiGLU backward's
                 five fp32 [64, 32] operands
  newton_schulz  64 x 64 x 32: the gemm's [64, 32] + [32, 64] fp32 operands, double-buffered, and its accumulator
"""
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig

MAX_NUM_WARPS = 16

# 64 KiB of LDS per workgroup (CDNA3, gfx942)
ROCM_CONFIGS = KernelConfigs(vendor="rocm", shared_memory_limit=64 * 1024, overrides={
    "indexer": LaunchConfig(num_warps=4, num_stages=1, blocks={"keys": 64},  # the default's key block
                            extra={"waves_per_eu": 2}),
    "sparse_mla": LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 4, "keys": 8},
                               extra={"waves_per_eu": 2}),
    "dsa_selected_attention_target": LaunchConfig(num_warps=4, num_stages=1,
                                                  blocks={"heads": 4, "keys": 8, "rows": 16, "cols": 8},
                                                  extra={"waves_per_eu": 2}),
    "moe_route": LaunchConfig(num_warps=4, num_stages=1, blocks={"tokens": 16}, extra={"waves_per_eu": 0}),
    "moe_permute": LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 512, "cols": 256},
                                extra={"waves_per_eu": 0}),
    "moe_experts": LaunchConfig(num_warps=8, num_stages=1, blocks={"m": 64, "n": 64, "k": 32},
                                extra={"waves_per_eu": 2, "matrix_instr_nonkdim": 16}),
    "newton_schulz": LaunchConfig(num_warps=8, num_stages=2, blocks={"m": 64, "n": 64, "k": 32},
                                  extra={"waves_per_eu": 2, "matrix_instr_nonkdim": 16}),
})

assert all(config.num_warps <= MAX_NUM_WARPS for config in ROCM_CONFIGS.overrides.values())
