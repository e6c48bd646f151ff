"""rocm launch configs (``glm5_core.backends.rocm.launch``) over the shared Triton kernels: AMD limits, the kernel
modules' defaults, an unknown family named, and the rocm kernel table running the shared kernels (interpreted
here, see tests/backends/triton)."""
import pytest
import torch

from glm5_core import registry, testing
from tests.backends.triton.helpers import kernel


def test_amd_configs_respect_wavefront_limits_and_share_the_indexer_layout():
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.rocm.launch import MAX_NUM_WARPS, ROCM_CONFIGS
    from glm5_core.backends.triton.table import launch_config, launches

    assert set(launches(ROCM_CONFIGS)) == set(launches(CUDA_CONFIGS))  # every kernel family launches on both
    for family, config in launches(ROCM_CONFIGS).items():
        assert config.num_warps <= MAX_NUM_WARPS == 16
        assert "waves_per_eu" not in launch_config(CUDA_CONFIGS, family).launch_kwargs()  # NVIDIA rejects it
    for config in ROCM_CONFIGS.overrides.values():  # a family without an override launches with the default
        assert "waves_per_eu" in config.launch_kwargs()
    # same scores, bit for bit
    assert launch_config(ROCM_CONFIGS, "indexer").blocks == launch_config(CUDA_CONFIGS, "indexer").blocks


def test_a_launch_family_falls_back_to_the_kernel_module_default_and_an_unknown_one_is_named():
    from glm5_core.backends.triton import sparse_mla
    from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig
    from glm5_core.backends.triton.table import launch_config, launches

    mine = LaunchConfig(num_warps=2)
    configs = KernelConfigs(vendor="toy", overrides={"indexer": mine})
    assert launch_config(configs, "indexer") is mine
    assert launch_config(configs, "sparse_mla") is sparse_mla.DEFAULT_LAUNCH
    assert configs.get("sparse_mla", sparse_mla.DEFAULT_LAUNCH) is sparse_mla.DEFAULT_LAUNCH
    with pytest.raises(KeyError, match="toy launch table: .*no Triton kernel module 'nope'.*indexer"):
        launch_config(configs, "nope")
    with pytest.raises(KeyError, match="toy launch table overrides 'nope', which is no Triton kernel module"):
        launches(KernelConfigs(vendor="toy", overrides={"nope": mine}))
    with pytest.raises(TypeError, match="toy launch table: indexer: expected a LaunchConfig"):
        KernelConfigs(vendor="toy", overrides={"indexer": {"num_warps": 4}})


def test_rocm_table_runs_the_shared_kernels(device):
    rows = {r.op: r for r in registry.explain("rocm")}
    assert rows["moe_experts"].label.startswith("rocm: glm5_core.backends.triton.moe_experts")  # shared code
    assert "torch.ops.glm5_rocm.indexer_topk" in rows["dsa_indexer_topk"].label  # own op namespace
    x = testing.make_indexer_inputs(testing.IndexerShape(B=2, T=3, S=20, H=2, D=16, K=5), device=device)
    cuda_idx = kernel("dsa_indexer_topk", "cuda")(x["q"], x["k"], x["w"], topk=5, start_pos=17)
    rocm_idx = kernel("dsa_indexer_topk", "rocm")(x["q"], x["k"], x["w"], topk=5, start_pos=17)
    assert torch.equal(cuda_idx, rocm_idx)
