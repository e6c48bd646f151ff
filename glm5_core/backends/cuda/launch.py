"""NVIDIA launch configurations for the shared Triton kernels (``glm5_core.backends.triton``)."""
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig
from glm5_core.backends.triton.shared_memory import SHARED_MEMORY_LIMITS

# NVIDIA (Hopper-class defaults; 32-lane warps). Every launch at GLM-5's dims fits the 227 KiB a block can opt into
# (tests/backends/triton/test_shared_memory.py); the largest, the fp32 sparse-MLA backward, needs 220 KiB.
CUDA_CONFIGS = KernelConfigs(vendor="cuda", shared_memory_limit=SHARED_MEMORY_LIMITS["cuda"], families={
    "indexer": LaunchConfig(num_warps=4, num_stages=2, blocks={"keys": 64}),
    "sparse_mla": LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 16, "keys": 32}),
    "dsa_selected_attention_target": LaunchConfig(num_warps=4, num_stages=1,
                                                  blocks={"heads": 16, "keys": 32, "rows": 32, "cols": 32}),
    "moe_route": LaunchConfig(num_warps=4, num_stages=1, blocks={"tokens": 16}),
    "moe_permute": LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 256, "cols": 128}),
    "moe_experts": LaunchConfig(num_warps=4, num_stages=3, blocks={"m": 64, "n": 64, "k": 32}),
    "newton_schulz": LaunchConfig(num_warps=4, num_stages=3, blocks={"m": 64, "n": 64, "k": 32}),
})
