"""Every registered launch of every Triton vendor (cuda, rocm, ...) fits its vendor's shared memory per block
(the interpreter does not check it: a launch over gfx942's 64 KiB of LDS passes under TRITON_INTERPRET=1 and
fails on an MI300X)."""
import os
import subprocess
import sys

import pytest

from glm5_core.backends.triton import shared_memory as smem
from glm5_core.backends.triton.launch import LaunchConfig
from tests.backends.triton.helpers import triton_vendor_configs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("vendor", sorted(triton_vendor_configs()))
def test_every_registered_launch_fits_the_vendor_shared_memory(vendor):
    """Every launch of every Triton vendor, its overrides and the kernel modules' defaults it keeps."""
    configs = triton_vendor_configs()[vendor]
    assert isinstance(configs.shared_memory_limit, int) and configs.shared_memory_limit > 0  # declared, in bytes
    from glm5_core.backends.triton import table

    launches = table.launches(configs)
    assert set(launches) == set(table.kernel_families())  # a launch configuration per kernel module
    assert all(callable(smem.family_tiles(family)) for family in launches)  # each with its estimate
    too_big = {(family, kernel, itemsize): need
               for family, config in launches.items()
               for (kernel, itemsize), need in smem.estimate(family, config).items()
               if need > configs.shared_memory_limit}
    assert not too_big, f"{vendor}: launches over {configs.shared_memory_limit} bytes: {too_big}"


def test_the_triton_vendors_are_found():
    assert {"cuda", "rocm"} <= set(triton_vendor_configs())


def test_the_estimate_flags_the_old_rocm_sparse_mla_backward():
    """heads 16 x keys 64 (the rocm table before) holds the [64, 512] fp32 key rows alone: 128 KiB."""
    old = LaunchConfig(num_warps=4, num_stages=1, blocks={"heads": 16, "keys": 64})
    need = smem.estimate("sparse_mla", old)
    assert need[("sparse_bwd_dkv", 4)] > triton_vendor_configs()["rocm"].shared_memory_limit
    assert need[("sparse_bwd_dkv", 4)] >= 64 * 512 * 4


def test_the_formula_counts_stages_for_pipelined_tiles_and_the_largest_scratch():
    tiles = [smem.Tile("a", (64, 32), 4, pipelined=True), smem.Tile("q", (16, 128), 2),
             smem.Tile("r1", (256,), 4, scratch=True), smem.Tile("r2", (1024,), 8, scratch=True)]
    assert smem.launch_bytes(tiles, num_stages=3) == 64 * 32 * 4 * 3 + 16 * 128 * 2 + 1024 * 8
    assert smem.launch_bytes(tiles, num_stages=1) == 64 * 32 * 4 + 16 * 128 * 2 + 1024 * 8
    with pytest.raises(KeyError, match="no shared-memory estimate for the Triton kernel family 'nope'"):
        smem.estimate("nope", LaunchConfig())


@pytest.mark.slow
def test_the_rocm_sparse_mla_kernels_compile_for_gfx942_within_its_lds():
    """Triton compiles the three sparse-MLA kernels for gfx942 ahead of time (no GPU: it stops at LLVM IR, where
    the LDS allocation is fixed): each fits 64 KiB and takes no more than the estimate."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "shared_memory_probe.py"),
                           "--targets", "rocm", "--families", "sparse_mla", "--check"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("| gfx942 | sparse_mla |") == 6  # fwd, dq, dkv x fp32, bf16


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_a_latent_width_whose_tiles_do_not_fit_runs_the_reference_with_the_reason(device, vendor):
    """supports() allows C <= 1024, Dr <= 256, but at C=1024, Dr=256 the fp32 tiles fit neither vendor's shared
    memory: the kernel declines (the reference runs) instead of failing to launch; GLM-5's 512 + 64 fits."""
    import torch

    from tests.backends.triton.helpers import kernel

    def inputs(C, DR):
        B, T, S, H, K = 1, 2, 4, 2, 2
        return (torch.zeros(B, T, H, 8, device=device), torch.zeros(B, T, H, DR, device=device),
                torch.zeros(B, S, C, device=device), torch.zeros(B, S, DR, device=device),
                torch.zeros(H, 8, C, device=device), torch.zeros(H, 8, C, device=device),
                torch.zeros(B, T, K, dtype=torch.int32, device=device))

    for op in ("dsa_sparse_prefill", "dsa_sparse_decode"):
        ok, why = kernel(op, vendor).supports(*inputs(1024, 256), scale=0.1)
        assert not ok and "C=1024" in why and "shared memory per block" in why, (op, why)
        assert kernel(op, vendor).supports(*inputs(512, 64), scale=0.1) == (True, ""), op
    ok, why = kernel("mla_decode", vendor).supports(*inputs(1024, 256)[:6], scale=0.1, start_pos=0)
    assert not ok and "shared memory per block" in why, why
