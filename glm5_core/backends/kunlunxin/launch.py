"""Kunlunxin launch configurations for the shared Triton kernels (Kunlunxin's Triton, FlagGems' ``xpu`` extras).

On-chip memory: Kunlunxin does not publish a per-block shared / local memory figure we could cite for the P800
(docs/vendors/kunlunxin.md). This table holds every launch to 64 KiB at GLM-5's dims by
``glm5_core.backends.triton.shared_memory``'s estimate (tests/backends/triton/test_shared_memory.py), the smallest
limit of the verified vendors, so it fits a device whose limit is at least that. ``num_warps`` 4: the value
FlagGems' Kunlunxin tuning table (its ``tune_configs.yaml``) uses most; the warp width is not published.
"""
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig

KUNLUNXIN_CONFIGS = KernelConfigs(vendor="kunlunxin", shared_memory_limit=64 * 1024, overrides={
    "indexer": LaunchConfig(num_warps=4, num_stages=1, blocks={"keys": 64}),
    "sparse_mla": LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 4, "keys": 8}),
    "dsa_selected_attention_target": LaunchConfig(num_warps=4, num_stages=1,
                                                  blocks={"heads": 4, "keys": 8, "rows": 16, "cols": 8}),
    "moe_route": LaunchConfig(num_warps=4, num_stages=1, blocks={"tokens": 16}),
    "moe_permute": LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 512, "cols": 256}),
    "moe_experts": LaunchConfig(num_warps=4, num_stages=1, blocks={"m": 64, "n": 64, "k": 32}),
    "newton_schulz": LaunchConfig(num_warps=4, num_stages=2, blocks={"m": 64, "n": 64, "k": 32}),
})
