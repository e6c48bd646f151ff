"""DSA lightning-indexer top-k: the reference (materialises [B, T, H, S] dot products) vs each requested
backend's kernel (``--backends``; the cpu backend's is a fused streaming kernel), same inputs.

Issue-4 targets (``--bench-large``), one run, medians:
  * 512 queries x 32K keys, 32 heads x 128 dims, fp32: cpu >= 1.3x faster than the reference and
    >= 8x less peak extra memory;
  * 512 queries x 128K keys: cpu < 2 GiB extra memory at >= 70% of the GEMM-bound time
    (2*T*S*H*D / fp32 matmul rate measured in the same test).
Queries are the last T positions (start_pos = S - T), so nearly every key is visible to every query.
"""
import pytest
from _backends import Impl, sizes
from _measure import fp32_matmul_rate, peak_extra_bytes

from glm5_core import testing

H, D, K = 32, 128, 2048
SMALL = sizes([(32, 8192)], [(8, 4096)])
LARGE = [(512, 32768)]
GIB = 1 << 30

_SETUP = """
from glm5_core import registry, testing
impl = registry.reference("dsa_indexer_topk") if {name!r} == "reference" \
else registry.resolve("dsa_indexer_topk", "cpu").impl
def make(T, S):
    return testing.make_indexer_inputs(testing.IndexerShape(B=1, T=T, S=S, H={H}, D={D}, K={K}), seed=0), S - T
"""
_RUN = """
(x, start) = inputs
impl(x["q"], x["k"], x["w"], topk={K}, start_pos=start)
"""


def _memory(name: str, T: int, S: int) -> int:
    return peak_extra_bytes(_SETUP.format(name=name, H=H, D=D, K=K), _RUN.format(K=K), args=f"{T}, {S}",
                            warm_args=f"4, {K}")


def _bench(benchmark, impl: Impl, T, S, rounds, measure_memory):
    fn = impl.op("dsa_indexer_topk")
    shape = testing.IndexerShape(B=1, T=T, S=S, H=H, D=D, K=K)
    x = impl.to(testing.make_indexer_inputs(shape, seed=0))
    benchmark.group = impl.group(f"dsa_indexer_topk T{T} S{S} H{H} D{D} K{K}")
    benchmark.extra_info.update(impl=impl.name, kind=impl.kind, device=impl.device, T=T, S=S, H=H, D=D, K=K,
                                flops=2 * T * S * H * D)
    benchmark.pedantic(impl.timed(lambda: fn(x["q"], x["k"], x["w"], topk=K, start_pos=S - T)), rounds=rounds,
                       iterations=1, warmup_rounds=1)
    if measure_memory and impl.device == "cpu" and impl.name in ("reference", "cpu"):  # host RSS: cpu only
        benchmark.extra_info["peak_extra_bytes"] = _memory(impl.name, T, S)
    return benchmark.stats.stats.median


@pytest.mark.parametrize("T,S", SMALL, ids=lambda v: str(v))
def test_indexer_topk(benchmark, impl, T, S):
    _bench(benchmark, impl, T, S, rounds=3, measure_memory=False)


@pytest.mark.large
@pytest.mark.parametrize("T,S", LARGE, ids=lambda v: str(v))
def test_indexer_topk_large(benchmark, impl, T, S):
    _bench(benchmark, impl, T, S, rounds=3, measure_memory=True)


@pytest.mark.large
def test_indexer_topk_128k_gemm_bound(benchmark, backend):
    """The backends' kernels only (the reference would need ~9 GiB here): memory and fraction of the GEMM bound
    (of the cpu fp32 matmul rate: meaningful for the cpu backend)."""
    if backend != "cpu":
        pytest.skip(f"{backend}: the GEMM bound here is the cpu fp32 matmul rate")
    T, S = 512, 131072
    median = _bench(benchmark, Impl("cpu", "backend", "cpu"), T, S, rounds=3, measure_memory=True)
    # The fp32 matmul rate is that of a compute-bound square GEMM: the indexer's own shape
    # ([T*H, 128] @ [128, S]) is bound by writing its huge output, which would flatter the kernel.
    rate = fp32_matmul_rate(2048, 2048, 2048)
    bound = 2 * T * S * H * D / rate
    benchmark.extra_info.update(matmul_flops_per_s=rate, gemm_bound_s=bound, fraction_of_gemm_bound=bound / median)
    assert benchmark.extra_info["peak_extra_bytes"] < 2 * GIB, "target: < 2 GiB extra memory at 128K keys"
