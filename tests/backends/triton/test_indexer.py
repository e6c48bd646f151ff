"""Fused indexer top-k and indexer scores (Triton) against the reference, ties, determinism, memory."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import dsa
from tests.backends.triton.helpers import kernel

S = testing.IndexerShape
SHAPES = (S(B=1, T=1, S=1, H=1, D=8, K=1), S(B=2, T=5, S=37, H=3, D=20, K=7), S(B=1, T=4, S=130, H=5, D=16, K=70))


def _inputs(shape, dtype, device, ties=None, seed=0):
    x = testing.make_indexer_inputs(shape, dtype=dtype, device=device, seed=seed, ties=ties)
    return x["q"], x["k"], x["w"]


def _starts(shape, mode, device):
    if mode == "tensor":
        hi = shape.S - shape.T
        return torch.tensor([hi - i * (hi // max(1, shape.B)) for i in range(shape.B)], device=device)
    return shape.S - shape.T if mode == "last" else 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("start_mode", ["zero", "tensor"])
def test_topk_equals_reference_selection_of_kernel_scores(shape, dtype, start_mode, device):
    """The fused top-k is exactly the contract's selection applied to the kernel's own scores, and
    those scores match the reference's."""
    q, k, w = _inputs(shape, dtype, device)
    start = _starts(shape, start_mode, device)
    scores = kernel("dsa_indexer_scores")(q, k, w, start_pos=start)
    ref_scores = dsa.indexer_scores_reference(q, k, w, start_pos=start)
    assert torch.equal(scores.isinf(), ref_scores.isinf())
    torch.testing.assert_close(scores.masked_fill(scores.isinf(), 0), ref_scores.masked_fill(ref_scores.isinf(), 0),
                               atol=1e-5, rtol=1e-5)
    idx = kernel("dsa_indexer_topk")(q, k, w, topk=shape.K, start_pos=start)
    assert idx.dtype == torch.int32 and idx.shape == (shape.B, shape.T, shape.K)
    assert torch.equal(idx, dsa._topk_from_scores(scores, shape.K, start))
    ref_idx = dsa.indexer_topk_reference(q, k, w, topk=shape.K, start_pos=start)
    verdict = testing.topk_sets_agree(idx, ref_idx, dsa.indexer_scores_reference(
        q.double(), k.double(), w.double(), start_pos=start), rel_tol=1e-5 if dtype == torch.float32 else 2e-2)
    assert verdict.passed, verdict.detail


@pytest.mark.parametrize("ties", ["zero_relu", "duplicate_keys", "integer", "bf16_quantised"])
def test_tie_heavy_inputs_match_reference_exactly(ties, device):
    shape = S(B=2, T=6, S=45, H=3, D=16, K=9)
    q, k, w = _inputs(shape, torch.float32, device, ties=ties)
    start = torch.tensor([shape.S - shape.T, 3], device=device)
    idx = kernel("dsa_indexer_topk")(q, k, w, topk=shape.K, start_pos=start)
    assert torch.equal(idx, dsa.indexer_topk_reference(q, k, w, topk=shape.K, start_pos=start))


def test_fewer_valid_keys_than_k_and_k_beyond_keys(device):
    shape = S(B=2, T=4, S=6, H=2, D=16, K=10)  # k > S, early rows see 1..4 keys
    q, k, w = _inputs(shape, torch.float32, device)
    idx = kernel("dsa_indexer_topk")(q, k, w, topk=shape.K, start_pos=0)
    assert torch.equal(idx, dsa.indexer_topk_reference(q, k, w, topk=shape.K, start_pos=0))
    assert (idx[:, 0, 1:] == -1).all() and (idx[:, 3, 4:] == -1).all()


def test_batch_invariance_and_prefill_decode_bitwise(device):
    """Same query row -> same bits, whatever the batch, the query chunking or the cache length."""
    shape = S(B=2, T=6, S=100, H=4, D=32, K=12)
    q, k, w = _inputs(shape, torch.float32, device, seed=3)
    topk = kernel("dsa_indexer_topk")
    start = shape.S - shape.T
    full = topk(q, k, w, topk=shape.K, start_pos=start)
    for b in range(shape.B):  # batch of one
        assert torch.equal(topk(q[b:b + 1], k[b:b + 1], w[b:b + 1], topk=shape.K, start_pos=start), full[b:b + 1])
    chunks = [topk(q[:, t0:t0 + 4], k, w[:, t0:t0 + 4], topk=shape.K, start_pos=start + t0) for t0 in (0, 4)]
    assert torch.equal(torch.cat(chunks, dim=1), full)
    for t in (0, shape.T - 1):  # decode: one query against a cache that ends at its position
        pos = start + t
        one = topk(q[:, t:t + 1], k[:, :pos + 1], w[:, t:t + 1], topk=shape.K, start_pos=pos)
        assert torch.equal(one[:, 0], full[:, t])
    ragged = topk(q[:, :1], k, w[:, :1], topk=shape.K, start_pos=torch.full((shape.B,), start, device=device))
    assert torch.equal(ragged[:, 0], full[:, 0])


def test_bitonic_merge_top_against_sort(device):
    from tests.backends.triton.bitonic_probe import merge_kernel

    g = torch.Generator().manual_seed(0)
    for n in (16, 64):
        values = torch.randperm(4 * n, generator=g)[:2 * n].to(torch.int64) * (2 ** 40) - 2 ** 50  # distinct
        best = values[:n].sort(descending=True).values
        staged = values[n:]
        out = torch.empty(n, dtype=torch.int64, device=device)
        merge_kernel[(1,)](best.to(device), staged.to(device), out, N=n)
        assert torch.equal(out.cpu(), values.sort(descending=True).values[:n])


def test_declines_fp64_with_reason():
    q, k, w = _inputs(S(B=1, T=2, S=3, H=1, D=8, K=2), torch.float64, "cpu")
    ok, why = kernel("dsa_indexer_topk").supports(q, k, w, topk=2)
    assert not ok and "fp64" in why


def test_batch_offsets_past_int32_do_not_wrap(device):
    """q rows whose element offset b * stride_b passes 2^31: int32 offset arithmetic would wrap to a
    negative offset (here exactly -2048 elements, kept inside the allocation so the wrong read is silent).

    The 8 GiB buffer is virtual on CPU: only the rows written below are ever touched."""
    B, T, H, D, S = 3, 1, 16, 16, 40
    stride_b = 2 ** 31 - 1024  # fits int32; 2 * stride_b = 2^32 - 2048 wraps to -2048
    base = 4096  # storage offset, so the wrapped read stays in bounds
    try:
        buffer = torch.empty(base + (B - 1) * stride_b + T * H * D, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError) as exc:
        pytest.skip(f"cannot reserve 8 GiB of address space: {exc}")
    buffer[base - 2048: base - 2048 + T * H * D].zero_()  # what a wrapped offset of row 2 would read
    q = buffer[base:].as_strided((B, T, H, D), (stride_b, H * D, D, 1))
    q_dense = testing.randn((B, T, H, D), seed=11, dtype=torch.float16, device=device)
    q.copy_(q_dense)
    k = testing.randn((B, S, D), seed=12, dtype=torch.float16, device=device)
    w = testing.randn((B, T, H), seed=13, device=device)
    start = S - T
    ref = dsa.indexer_topk_reference(q_dense, k, w, topk=8, start_pos=start)
    assert torch.equal(kernel("dsa_indexer_topk")(q, k, w, topk=8, start_pos=start), ref)
    scores = kernel("dsa_indexer_scores")(q, k, w, start_pos=start)
    assert torch.equal(scores, kernel("dsa_indexer_scores")(q_dense, k, w, start_pos=start))


def test_scores_overflowing_to_nan_raise_like_the_reference(device):
    """Finite inputs whose dots overflow to inf, weighted +1 and -1: inf - inf = NaN has no place in the order."""
    q = torch.full((1, 2, 2, 16), 1e20, device=device)
    k = torch.full((1, 4, 16), 1e20, device=device)
    w = torch.tensor([[[1.0, -1.0], [1.0, -1.0]]], device=device)
    with pytest.raises(ValueError, match="overflowed to NaN"):
        dsa.indexer_topk_reference(q, k, w, topk=2, start_pos=2)
    with pytest.raises(ValueError, match="overflowed to NaN"):
        kernel("dsa_indexer_topk")(q, k, w, topk=2, start_pos=2)
    from glm5_core.ops import _checks

    with _checks.skip_value_checks():  # the flags are not read (no device sync) when value checks are off
        assert kernel("dsa_indexer_topk")(q, k, w, topk=2, start_pos=2).shape == (1, 2, 2)


def test_declines_a_topk_tile_past_tritons_largest_tensor(device):
    """The tile holds min(topk, S) keys: a topk far past a short row's keys runs (its output is -1 padded),
    only a row with that many keys is past Triton's largest tensor."""
    import triton.language as tl

    huge = tl.TRITON_MAX_TENSOR_NUMEL + 1
    q, k, w = _inputs(S(B=1, T=1, S=4, H=2, D=16, K=1), torch.float32, device)
    assert kernel("dsa_indexer_topk").supports(q, k, w, topk=huge, start_pos=3) == (True, "")
    many_keys = k[:, :1].expand(1, huge, 16)  # [1, huge, D]: a view; supports reads shapes only
    ok, why = kernel("dsa_indexer_topk").supports(q, many_keys, w, topk=huge, start_pos=3)
    assert not ok and "topk" in why
    assert kernel("dsa_indexer_topk").supports(q, k, w, topk=2048, start_pos=3) == (True, "")
    out = dsa.indexer_topk(q, k, w, huge, start_pos=3, backend="cuda")
    assert out.shape == (1, 1, huge)
    assert torch.equal(out, dsa.indexer_topk_reference(q, k, w, topk=huge, start_pos=3))
