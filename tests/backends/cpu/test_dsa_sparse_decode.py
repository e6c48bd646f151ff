"""Native sparse MLA decode vs the reference (judged against an fp64 reference run), and its determinism."""
import functools

import pytest
import torch

from glm5_core import testing
from glm5_core.backends.cpu import dsa as native_dsa
from glm5_core.ops import dsa

SHAPES = (
    (testing.MLAShape(B=1, T=1, S=1, H=1, Dn=8, Dr=4, Dv=8, C=16), 1),
    (testing.MLAShape(B=2, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24), 4),
    (testing.MLAShape(B=2, T=3, S=400, H=5, Dn=16, Dr=8, Dv=12, C=37), 300),  # 3 key chunks, odd C
)
NAMES = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")


def _run(fn, inputs, scale=0.3):
    return fn(*(inputs[n] for n in NAMES), inputs["topk_idx"], scale=scale)


@pytest.mark.parametrize("shape,K", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=str)
def test_matches_reference(native, shape, K, dtype, index_dtype):
    inputs = testing.make_sparse_inputs(shape, K, dtype=dtype, seed=2)
    inputs["topk_idx"] = inputs["topk_idx"].to(index_dtype)
    got = _run(native_dsa.sparse_decode, inputs)
    same_precision = _run(dsa.sparse_attention_reference, inputs)
    as64 = {n: (t.to(torch.float64) if t.is_floating_point() else t) for n, t in inputs.items()}
    exact = _run(dsa.sparse_attention_reference, as64)
    assert got.dtype == dtype and got.shape == exact.shape
    verdict = testing.compare_to_fp64(got, same_precision, exact, dtype)
    assert verdict.passed, verdict.detail
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))  # the row with no selected key


def test_thread_and_batch_invariance_bitwise(native, threads):
    shape, K = SHAPES[2]
    inputs = testing.make_sparse_inputs(shape, K, seed=4)
    results = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        results.append(_run(native_dsa.sparse_decode, inputs))
    assert all(torch.equal(r, results[0]) for r in results[1:])
    # The native attention core is batch invariant bitwise (the torch GEMMs around it, absorbing W_UK and
    # projecting through W_UV, are not promised to be: MKL may pick another kernel for another batch).
    q_lat = torch.randn(shape.B, shape.T, shape.H, shape.C)
    core = [inputs["q_pe"], inputs["c_kv"], inputs["k_pe"], inputs["topk_idx"]]
    whole = torch.ops.glm5_cpu.sparse_decode(q_lat, *core, 0.3)
    q_pe, c_kv, k_pe, idx = core
    alone = torch.ops.glm5_cpu.sparse_decode(q_lat[1:2, 2:3], q_pe[1:2, 2:3], c_kv[1:2], k_pe[1:2], idx[1:2, 2:3], 0.3)
    assert torch.equal(alone[0, 0], whole[1, 2])


def test_declines_autograd(native):
    shape, K = SHAPES[1]
    inputs = testing.make_sparse_inputs(shape, K, seed=1)
    inputs["q_nope"].requires_grad_(True)
    why = native_dsa.KERNELS["dsa_sparse_decode"].declines((*(inputs[n] for n in NAMES), inputs["topk_idx"]),
                                                           {"scale": 0.3})
    assert "backward" in why
    out = dsa.sparse_decode(*(inputs[n] for n in NAMES), inputs["topk_idx"], scale=0.3, backend="cpu")
    out.sum().backward()  # fell back to the differentiable reference
    assert inputs["q_nope"].grad is not None


PREFILL_BLOCKS_SCRIPT = """
import resource, torch
from glm5_core.backends.cpu import backend
assert backend.status().built
B, T, H, C, R, S, K = 1, 4096, 4, 256, 8, 4096, 2048  # 16 key chunks per query
g = torch.Generator().manual_seed(0)
q_lat, q_pe = torch.randn(B, T, H, C, generator=g), torch.randn(B, T, H, R, generator=g)
c_kv, k_pe = torch.randn(B, S, C, generator=g), torch.randn(B, S, R, generator=g)
idx = torch.full((B, T, K), -1, dtype=torch.int64)
idx[..., :3] = torch.randint(0, S, (B, T, 3), generator=g)  # cheap to compute; every chunk still has a partial
idx[..., 1500] = torch.randint(0, S, (B, T), generator=g)  # and a key in a later chunk
torch.ops.glm5_cpu.sparse_decode(q_lat[:, :1], q_pe[:, :1], c_kv, k_pe, idx[:, :1], 0.5)  # warm up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
whole = torch.ops.glm5_cpu.sparse_decode(q_lat, q_pe, c_kv, k_pe, idx, 0.5)
grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
all_partials_mib = B * T * (K // 128) * H * C * 4 / 2**20
assert grown_mib < all_partials_mib / 2, (grown_mib, all_partials_mib)
for t in (0, 507, 508, 1015, 1016, 2032, 4095):  # both sides of the kernel's row blocks (508 rows here)
    alone = torch.ops.glm5_cpu.sparse_decode(q_lat[:, t:t + 1], q_pe[:, t:t + 1], c_kv, k_pe, idx[:, t:t + 1], 0.5)
    assert torch.equal(alone[:, 0], whole[:, t]), t
print("bounded and bitwise per row")
"""


def test_prefill_working_set_is_bounded(native):
    """A prefill's queries go through in row blocks, each row bitwise as if alone. The kernel held the chunk
    partials of ALL queries at once (T * K/128 * H * C floats: 256 MiB here, 17 GiB for an 8K-token prefill at
    GLM-5 sizes) before merging them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PREFILL_BLOCKS_SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "bitwise per row" in done.stdout, done.stdout[-500:] + done.stderr[-2000:]


def test_index_past_the_cache_raises_with_value_checks_off(native, monkeypatch):
    """GLM5_CHECK_VALUES=0 skips the public range check; the kernel read rows past the cache (garbage or a
    segfault) where the reference raises IndexError. Negative entries still mean "no key"."""
    shape, K = SHAPES[1]
    inputs = testing.make_sparse_inputs(shape, K, seed=6)
    monkeypatch.setenv("GLM5_CHECK_VALUES", "0")
    inputs["topk_idx"][1, 0, 0] = -3
    torch.testing.assert_close(_run(native_dsa.sparse_decode, inputs), _run(dsa.sparse_attention_reference, inputs))
    inputs["topk_idx"][-1, -1, -1] = shape.S  # one past the last slot of the last batch row
    with pytest.raises(IndexError):
        _run(dsa.sparse_attention_reference, inputs)
    with pytest.raises(IndexError, match="past the cache"):
        _run(native_dsa.sparse_decode, inputs)
    with pytest.raises(IndexError, match="past the cache"):
        _run(functools.partial(dsa.sparse_decode, backend="cpu"), inputs)
