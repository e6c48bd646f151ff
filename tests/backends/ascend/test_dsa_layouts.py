"""The ascend DSA kernels on the executable vendor semantics: indices must equal the reference's exactly
(top-k contract), sparse attention must be within tolerance of it."""
import itertools

import pytest
import torch

from glm5_core import testing
from glm5_core.backends.ascend import dsa
from glm5_core.backends.ascend import dsa_layouts as L
from glm5_core.ops.dsa import indexer_scores_reference, indexer_topk_reference, sparse_attention_reference
from tests.backends.ascend.vendor_semantics import AscendSemantics, VendorContractError

TIE_ORDERS = ("high_first", "low_first")
D = L.VENDOR_INDEX_HEAD_DIM
INDEXER_SHAPES = (
    testing.IndexerShape(B=1, T=1, S=1, H=1, D=D, K=1),
    testing.IndexerShape(B=3, T=5, S=23, H=3, D=D, K=4),
    testing.IndexerShape(B=2, T=6, S=9, H=64, D=D, K=16),  # k above the visible keys of every row
)


def _indexer_inputs(shape, dtype, ties=None, seed=0):
    inputs = testing.make_indexer_inputs(shape, dtype=dtype, seed=seed, ties=ties)
    inputs["w"] = inputs["w"].to(dtype).float()  # weights the vendor's dtype holds exactly (see limits)
    return inputs


def test_prefix_sums_are_int32_cumulative():
    out = L.prefix_sums(torch.tensor([3, 0, 5]))
    assert out.dtype == torch.int32 and out.tolist() == [3, 3, 8]


def test_padding_heads_leaves_scores_bit_identical():
    q, k, w = _indexer_inputs(INDEXER_SHAPES[1], torch.bfloat16).values()
    qp, wp = L.pad_query_heads(q, w, L.VENDOR_QUERY_HEADS)
    assert qp.shape[2] == wp.shape[2] == 64
    assert torch.equal(indexer_scores_reference(qp, k, wp, start_pos=2), indexer_scores_reference(q, k, w, start_pos=2))


def test_ragged_start_positions_use_tnd_with_packed_keys():
    shape = INDEXER_SHAPES[1]
    q, k, w = _indexer_inputs(shape, torch.bfloat16).values()
    start = torch.tensor([4, 0, 11])
    call = L.indexer_call(q, k, w, start, sparse_count=5)
    lengths = (start + shape.T).tolist()  # keys each row sees
    assert call.layout == "TND"
    assert tuple(call.query.shape) == (shape.B * shape.T, 64, D)
    assert tuple(call.weights.shape) == (shape.B * shape.T, 64)
    assert call.actual_seq_lengths_query.tolist() == [5, 10, 15]
    assert call.actual_seq_lengths_key.dtype == torch.int32
    assert call.actual_seq_lengths_key.tolist() == torch.tensor(lengths).cumsum(0).tolist()
    assert torch.equal(call.key[:, 0], torch.cat([k[b, :lengths[b]] for b in range(shape.B)]))


def test_uniform_start_position_uses_bsnd_with_row_lengths():
    shape = INDEXER_SHAPES[1]
    q, k, w = _indexer_inputs(shape, torch.float16).values()
    call = L.indexer_call(q, k, w, 7, sparse_count=5)
    assert call.layout == "BSND" and tuple(call.key.shape) == (shape.B, shape.S, 1, D)
    assert call.actual_seq_lengths_key.tolist() == [7 + shape.T] * shape.B
    assert call.query.dtype == call.weights.dtype == torch.float16


@pytest.mark.parametrize("shape,mode,dtype,tie_order", list(itertools.product(
    INDEXER_SHAPES, ("first", "last", "ragged"), (torch.bfloat16, torch.float16), TIE_ORDERS)), ids=str)
def test_indexer_topk_matches_reference(shape, mode, dtype, tie_order):
    inputs = _indexer_inputs(shape, dtype, seed=3)
    start = testing.start_positions_for(shape.B, shape.T, shape.S, mode)
    assert dsa.indexer_topk_limits(**inputs, topk=shape.K, start_pos=start) == (True, "")
    out = dsa.indexer_topk(**inputs, topk=shape.K, start_pos=start, npu=AscendSemantics(tie_order))
    ref = indexer_topk_reference(**inputs, topk=shape.K, start_pos=start)
    assert out.dtype == torch.int32
    assert torch.equal(out, ref)


@pytest.mark.parametrize("ties,mode,tie_order", list(itertools.product(
    ("zero_relu", "duplicate_keys", "integer", "bf16_quantised"), ("last", "ragged"), TIE_ORDERS)), ids=str)
def test_indexer_topk_restores_lower_index_tie_order(ties, mode, tie_order):
    shape = testing.IndexerShape(B=3, T=4, S=17, H=2, D=D, K=5)
    inputs = _indexer_inputs(shape, torch.bfloat16, ties=ties, seed=5)
    start = testing.start_positions_for(shape.B, shape.T, shape.S, mode)
    out = dsa.indexer_topk(**inputs, topk=shape.K, start_pos=start, npu=AscendSemantics(tie_order))
    assert torch.equal(out, indexer_topk_reference(**inputs, topk=shape.K, start_pos=start))


class _Spy(AscendSemantics):
    def npu_lightning_indexer(self, *args, **kwargs):
        self.sparse_count = kwargs["sparse_count"]
        return super().npu_lightning_indexer(*args, **kwargs)


@pytest.mark.parametrize("topk,asked", [(5, 6), (2047, 2048), (2048, 2048)])
def test_one_extra_candidate_is_requested_below_the_vendor_cap(topk, asked):
    shape = testing.IndexerShape(B=1, T=2, S=6, H=2, D=D, K=topk)
    inputs = _indexer_inputs(shape, torch.bfloat16)
    spy = _Spy()
    out = dsa.indexer_topk(**inputs, topk=topk, start_pos=4, npu=spy)
    assert spy.sparse_count == asked
    assert torch.equal(out, indexer_topk_reference(**inputs, topk=topk, start_pos=4))


class _KeyLengthOffByOne(AscendSemantics):
    """A backend bug to be caught: every row boundary of the keys one slot early (the packed total kept)."""

    def npu_lightning_indexer(self, *args, **kwargs):
        lengths = kwargs["actual_seq_lengths_key"].clone()
        if kwargs["layout_key"] == "TND":
            lengths[:-1] -= 1
        else:
            lengths -= 1
        kwargs["actual_seq_lengths_key"] = lengths
        return super().npu_lightning_indexer(*args, **kwargs)


@pytest.mark.parametrize("mode", ["first", "ragged"])  # rows that see few keys notice a missing one
def test_an_off_by_one_in_the_key_lengths_is_detected(mode):
    shape = INDEXER_SHAPES[1]
    inputs = _indexer_inputs(shape, torch.bfloat16)
    start = testing.start_positions_for(shape.B, shape.T, shape.S, mode)
    out = dsa.indexer_topk(**inputs, topk=shape.K, start_pos=start, npu=_KeyLengthOffByOne())
    assert not torch.equal(out, indexer_topk_reference(**inputs, topk=shape.K, start_pos=start))


def test_a_broken_prefix_sum_breaks_the_vendor_contract():
    shape = INDEXER_SHAPES[1]
    q, k, w = _indexer_inputs(shape, torch.bfloat16).values()
    call = L.indexer_call(q, k, w, torch.tensor([1, 0, 2]), sparse_count=4)
    kwargs = call.kwargs()
    kwargs["actual_seq_lengths_key"] = kwargs["actual_seq_lengths_key"].flip(0)  # decreasing
    with pytest.raises(VendorContractError):
        AscendSemantics().npu_lightning_indexer(call.query, call.key, call.weights, **kwargs)


@pytest.mark.parametrize("change,needle", [
    (dict(D=64), "head dim 128"),
    (dict(H=65), "at most 64"),
    (dict(K=2049), "2048"),
])
def test_indexer_limits_decline_outside_the_vendor_op(change, needle):
    base = dict(B=1, T=2, S=8, H=2, D=D, K=4)
    base.update(change)
    shape = testing.IndexerShape(**base)
    inputs = _indexer_inputs(shape, torch.bfloat16)
    ok, why = dsa.indexer_topk_limits(**inputs, topk=shape.K, start_pos=0)
    assert not ok and needle in why


def test_indexer_limits_decline_fp32_and_inexact_weights():
    shape = INDEXER_SHAPES[1]
    fp32 = testing.make_indexer_inputs(shape, dtype=torch.float32)
    ok, why = dsa.indexer_topk_limits(**fp32, topk=4, start_pos=0)
    assert not ok and "float32" in why
    bf16 = testing.make_indexer_inputs(shape, dtype=torch.bfloat16)  # fp32 weights with full mantissas
    ok, why = dsa.indexer_topk_limits(**bf16, topk=4, start_pos=0)
    assert not ok and "weights" in why


def test_supports_declines_tensors_off_the_npu():
    inputs = _indexer_inputs(INDEXER_SHAPES[1], torch.bfloat16)
    ok, why = dsa.KERNELS["dsa_indexer_topk"].supports(**inputs, topk=4, start_pos=0)
    assert not ok and "npu" in why


# ------------------------------------------------------------------------------ sparse flash attention
SPARSE_SHAPES = (
    testing.MLAShape(B=2, T=3, S=19, H=4, Dn=16, Dr=64, Dv=24, C=512),
    testing.MLAShape(B=1, T=1, S=5, H=1, Dn=8, Dr=64, Dv=8, C=512),
)


def test_compact_indices_moves_padding_last_and_fills_empty_rows():
    idx = torch.tensor([[[3, -1, 5, -1], [-1, -1, -1, -1], [-1, 2, 2, 0]]], dtype=torch.int32)
    packed, has_key = L.compact_indices(idx)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (1, 3, 1, 4)
    assert packed[0, :, 0].tolist() == [[3, 5, -1, -1], [0, -1, -1, -1], [2, 2, 0, -1]]
    assert has_key.tolist() == [[True, False, True]]


def _scramble(idx, seed):
    """Put -1 entries in the middle of rows and repeat a key, both allowed by our contract."""
    g = testing.generator(seed)
    out = idx.clone()
    for b in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            out[b, t] = idx[b, t, torch.randperm(idx.shape[2], generator=g)]
    if out.shape[1] > 1 and out[-1, -1, 0] >= 0:
        out[-1, -1, -1] = out[-1, -1, 0]
    return out


@pytest.mark.parametrize("shape,dtype", list(itertools.product(SPARSE_SHAPES, (torch.bfloat16, torch.float16))),
                         ids=str)
def test_sparse_attention_matches_reference(shape, dtype):
    inputs = testing.make_sparse_inputs(shape, K=6, dtype=dtype, seed=2)
    inputs["topk_idx"] = _scramble(inputs["topk_idx"], seed=9)
    scale = (shape.Dn + shape.Dr) ** -0.5
    assert dsa.sparse_attention_limits(**inputs, scale=scale) == (True, "")
    out = dsa.sparse_attention(**inputs, scale=scale, npu=AscendSemantics())
    ref = sparse_attention_reference(**inputs, scale=scale)
    exact = sparse_attention_reference(**{k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()},
                                       scale=scale)
    assert out.dtype == dtype and torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))  # the row without keys
    result = testing.compare_to_fp64(out, ref, exact, dtype)
    assert result.passed, result.detail


@pytest.mark.parametrize("change,needle", [
    (dict(C=256), "latent 512"),
    (dict(Dr=32), "rope 64"),
    (dict(H=3), "query heads"),
])
def test_sparse_attention_limits(change, needle):
    base = dict(B=1, T=2, S=6, H=2, Dn=8, Dr=64, Dv=8, C=512)
    base.update(change)
    inputs = testing.make_sparse_inputs(testing.MLAShape(**base), K=3, dtype=torch.bfloat16)
    ok, why = dsa.sparse_attention_limits(**inputs, scale=0.1)
    assert not ok and needle in why


def test_sparse_attention_declines_fp32_and_training():
    inputs = testing.make_sparse_inputs(SPARSE_SHAPES[0], K=3, dtype=torch.float32)
    ok, why = dsa.sparse_attention_limits(**inputs, scale=0.1)
    assert not ok and "float32" in why
    inputs["q_nope"].requires_grad_(True)
    assert "no backward" in dsa.KERNELS["dsa_sparse_prefill"].declines((), inputs)
