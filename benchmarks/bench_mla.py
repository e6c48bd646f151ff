"""MLA decode against a long latent cache: dense absorbed decode (``ops.mla.decode`` reference) vs DSA
sparse decode over the top-k selected rows: the reference and each requested backend's kernel
(``--backends``); ``dense_reference`` is the peer (what decode costs without DSA).

Issue-4 target (``--bench-large``): 64K-token latent cache, top-k 2048, 16 heads: the cpu sparse decode
>= 10x faster than dense absorbed decode. GLM-5 widths: C=512 latent, 64 rope, 192 nope, 256 value.
"""
import pytest
import torch
from _backends import Impl, sizes

from glm5_core import registry, testing

H, DN, DR, DV, C, K = 16, 192, 64, 256, 512, 2048
SMALL = sizes([8192], [2048])
LARGE = [65536]
NAMES = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")


def _inputs(S, k):
    shape = testing.MLAShape(B=1, T=1, S=S, H=H, Dn=DN, Dr=DR, Dv=DV, C=C)
    x = testing.make_mla_inputs(shape, seed=0)
    x["topk_idx"] = torch.randperm(S, generator=testing.generator(1))[:k].view(1, 1, k).to(torch.int32)
    return [x[n] for n in NAMES], x["topk_idx"], DN ** -0.5


def _run(benchmark, S, impl: Impl, rounds):
    k = min(K, S // 2)
    fn = registry.reference("mla_decode") if impl.name == "dense_reference" else impl.op("dsa_sparse_decode")
    tensors, idx, scale = impl.to(_inputs(S, k))
    benchmark.group = impl.group(f"mla_decode S{S} H{H} K{k}")
    benchmark.extra_info.update(impl=impl.name, kind=impl.kind, device=impl.device, S=S, H=H, K=k, C=C)
    if impl.name == "dense_reference":
        call = impl.timed(lambda: fn(*tensors, scale=scale, start_pos=S - 1))
    else:
        call = impl.timed(lambda: fn(*tensors, idx, scale=scale))
    benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)


@pytest.mark.peers("dense_reference")
@pytest.mark.parametrize("S", SMALL)
def test_decode(benchmark, impl, S):
    with torch.no_grad():
        _run(benchmark, S, impl, rounds=5)


@pytest.mark.large
@pytest.mark.peers("dense_reference")
@pytest.mark.parametrize("S", LARGE)
def test_decode_large(benchmark, impl, S):
    with torch.no_grad():
        _run(benchmark, S, impl, rounds=7)
