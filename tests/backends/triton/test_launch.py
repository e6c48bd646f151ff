"""Every Triton vendor's effective launch configurations (its override, else the kernel module's default) are
exactly the tables as they stood before the defaults moved into the kernel modules (issue 30, item 2): a literal
copy of ``backends/cuda/launch.py`` and ``backends/rocm/launch.py`` at e663cfe."""
import pytest

from glm5_core.backends.triton.launch import LaunchConfig

WAVES_2 = {"waves_per_eu": 2}
MFMA = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16}

TABLES_AT_E663CFE = {
    "cuda": (227 * 1024, {
        "indexer": LaunchConfig(num_warps=4, num_stages=2, blocks={"keys": 64}),
        "sparse_mla": LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 16, "keys": 32}),
        "dsa_selected_attention_target": LaunchConfig(num_warps=4, num_stages=1,
                                                      blocks={"heads": 16, "keys": 32, "rows": 32, "cols": 32}),
        "moe_route": LaunchConfig(num_warps=4, num_stages=1, blocks={"tokens": 16}),
        "moe_permute": LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 256, "cols": 128}),
        "moe_experts": LaunchConfig(num_warps=4, num_stages=3, blocks={"m": 64, "n": 64, "k": 32}),
        "newton_schulz": LaunchConfig(num_warps=4, num_stages=3, blocks={"m": 64, "n": 64, "k": 32}),
    }),
    "rocm": (64 * 1024, {
        "indexer": LaunchConfig(num_warps=4, num_stages=1, blocks={"keys": 64}, extra=WAVES_2),
        "sparse_mla": LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 4, "keys": 8}, extra=WAVES_2),
        "dsa_selected_attention_target": LaunchConfig(num_warps=4, num_stages=1,
                                                      blocks={"heads": 4, "keys": 8, "rows": 16, "cols": 8},
                                                      extra=WAVES_2),
        "moe_route": LaunchConfig(num_warps=4, num_stages=1, blocks={"tokens": 16}, extra={"waves_per_eu": 0}),
        "moe_permute": LaunchConfig(num_warps=4, num_stages=1, blocks={"rows": 512, "cols": 256},
                                    extra={"waves_per_eu": 0}),
        "moe_experts": LaunchConfig(num_warps=8, num_stages=1, blocks={"m": 64, "n": 64, "k": 32}, extra=MFMA),
        "newton_schulz": LaunchConfig(num_warps=8, num_stages=2, blocks={"m": 64, "n": 64, "k": 32}, extra=MFMA),
    }),
}


def _configs(vendor):
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.rocm.launch import ROCM_CONFIGS

    return {"cuda": CUDA_CONFIGS, "rocm": ROCM_CONFIGS}[vendor]


def _comparable(config: LaunchConfig):
    return config.num_warps, config.num_stages, dict(config.blocks), dict(config.extra)


@pytest.mark.parametrize("vendor", sorted(TABLES_AT_E663CFE))
def test_the_effective_launch_configs_are_the_tables_of_e663cfe(vendor):
    from glm5_core.backends.triton import table

    limit, expected = TABLES_AT_E663CFE[vendor]
    configs = _configs(vendor)
    assert configs.vendor == vendor and configs.shared_memory_limit == limit
    assert set(expected) <= set(table.kernel_families())  # (a kernel module added since has its own tests)
    launches = table.launches(configs)
    effective = {family: _comparable(launches[family]) for family in expected}
    assert effective == {family: _comparable(config) for family, config in expected.items()}
    for family in expected:  # what the kernels read: the override, else the module's default
        module = table.kernel_module(family)
        assert _comparable(configs.get(module.FAMILY, module.DEFAULT_LAUNCH)) == effective[family]
    for family in expected:  # the launch keywords the kernels receive, too
        assert table.launch_config(configs, family).launch_kwargs() == expected[family].launch_kwargs()
