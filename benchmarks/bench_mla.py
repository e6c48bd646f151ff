"""MLA decode against a long latent cache: dense absorbed decode (``ops.mla.decode`` reference) vs DSA
sparse decode over the top-k selected rows (reference and cpu native).

Issue-4 target (``--bench-large``): 64K-token latent cache, top-k 2048, 16 heads: the cpu sparse decode
>= 10x faster than dense absorbed decode. GLM-5 widths: C=512 latent, 64 rope, 192 nope, 256 value.
"""
import pytest
import torch
from _measure import implementations

from glm5_core import registry, testing

H, DN, DR, DV, C, K = 16, 192, 64, 256, 512, 2048
SMALL = [8192]
LARGE = [65536]
NAMES = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")


def _inputs(S):
    shape = testing.MLAShape(B=1, T=1, S=S, H=H, Dn=DN, Dr=DR, Dv=DV, C=C)
    x = testing.make_mla_inputs(shape, seed=0)
    x["topk_idx"] = torch.randperm(S, generator=testing.generator(1))[:K].view(1, 1, K).to(torch.int32)
    return [x[n] for n in NAMES], x["topk_idx"], DN ** -0.5


def _run(benchmark, S, name, rounds):
    tensors, idx, scale = _inputs(S)
    benchmark.group = f"mla_decode S{S} H{H} K{K}"
    benchmark.extra_info.update(impl=name, S=S, H=H, K=K, C=C)
    if name == "dense_reference":
        fn = registry.reference("mla_decode")
        benchmark.pedantic(lambda: fn(*tensors, scale=scale, start_pos=S - 1), rounds=rounds, iterations=1,
                           warmup_rounds=1)
        return
    impls = implementations("dsa_sparse_decode")
    impl_name = name.replace("sparse_", "")
    if impl_name not in impls:
        pytest.skip("native extension not built")
    fn = impls[impl_name]
    benchmark.pedantic(lambda: fn(*tensors, idx, scale=scale), rounds=rounds, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("S", SMALL)
@pytest.mark.parametrize("name", ["dense_reference", "sparse_reference", "sparse_cpu"])
def test_decode(benchmark, name, S):
    with torch.no_grad():
        _run(benchmark, S, name, rounds=5)


@pytest.mark.large
@pytest.mark.parametrize("S", LARGE)
@pytest.mark.parametrize("name", ["dense_reference", "sparse_reference", "sparse_cpu"])
def test_decode_large(benchmark, name, S):
    with torch.no_grad():
        _run(benchmark, S, name, rounds=7)
