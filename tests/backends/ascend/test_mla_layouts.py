"""The ascend MLA decode kernel on the executable semantics of npu_fused_infer_attention_score (MLA, paged)."""
import itertools

import pytest
import torch

from glm5_core import testing
from glm5_core.backends.ascend import mla
from glm5_core.backends.ascend import mla_layouts as L
from glm5_core.ops.mla import decode_reference
from tests.backends.ascend.vendor_semantics import AscendSemantics, VendorContractError

DECODE_SHAPES = (
    testing.MLAShape(B=2, T=1, S=150, H=32, Dn=16, Dr=64, Dv=16, C=512),  # cache padded to 2 blocks
    testing.MLAShape(B=3, T=3, S=128, H=32, Dn=8, Dr=64, Dv=8, C=512),  # exactly one block, T > 1
)


def test_paged_cache_round_trips_and_tables_are_row_local():
    cache = torch.arange(2 * 150 * 3, dtype=torch.float32).view(2, 150, 3)
    paged, table = L.paged_cache(cache, block_size=128)
    assert tuple(paged.shape) == (4, 128, 3) and table.dtype == torch.int32
    assert table.tolist() == [[0, 1], [2, 3]]
    for b in range(2):
        rows = torch.cat([paged[i] for i in table[b].tolist()])
        assert torch.equal(rows[:150], cache[b]) and not rows[150:].any()


def test_compressed_mask_masks_the_future_only():
    mask = L.compressed_causal_mask(torch.device("cpu"))
    assert tuple(mask.shape) == (2048, 2048)
    assert torch.equal(mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))


@pytest.mark.parametrize("shape,mode,dtype", list(itertools.product(
    DECODE_SHAPES, ("last", "ragged"), (torch.bfloat16, torch.float16))), ids=str)
def test_decode_matches_reference(shape, mode, dtype):
    inputs = testing.make_mla_inputs(shape, dtype=dtype, seed=4)
    start = testing.start_positions_for(shape.B, shape.T, shape.S, mode)
    scale = (shape.Dn + shape.Dr) ** -0.5
    assert mla.decode_limits(**inputs, scale=scale, start_pos=start) == (True, "")
    npu = AscendSemantics()
    out = mla.decode(**inputs, scale=scale, start_pos=start, npu=npu)
    assert npu.calls == ["npu_fused_infer_attention_score"] and out.dtype == dtype
    ref = decode_reference(**inputs, scale=scale, start_pos=start)
    exact = decode_reference(**{k: v.double() for k, v in inputs.items()}, scale=scale, start_pos=start)
    result = testing.compare_to_fp64(out, ref, exact, dtype)
    assert result.passed, result.detail


class _NoQueryOffset(AscendSemantics):
    """A backend bug to be caught: key lengths that forget the new queries (start_pos instead of start_pos + T)."""

    def npu_fused_infer_attention_score(self, *args, **kwargs):
        T = args[0].shape[1]
        kwargs["actual_seq_lengths_kv"] = [n - T for n in kwargs["actual_seq_lengths_kv"]]
        return super().npu_fused_infer_attention_score(*args, **kwargs)


def test_an_off_by_one_in_the_key_lengths_is_detected():
    shape = DECODE_SHAPES[1]
    inputs = testing.make_mla_inputs(shape, dtype=torch.bfloat16, seed=4)
    start = torch.tensor([20, 60, 100])
    scale = 0.1
    out = mla.decode(**inputs, scale=scale, start_pos=start, npu=_NoQueryOffset())
    ref = decode_reference(**inputs, scale=scale, start_pos=start)
    exact = decode_reference(**{k: v.double() for k, v in inputs.items()}, scale=scale, start_pos=start)
    assert not testing.compare_to_fp64(out, ref, exact, torch.bfloat16).passed


def test_single_query_uses_no_mask_and_multi_query_the_causal_mode():
    one = testing.make_mla_inputs(DECODE_SHAPES[0], dtype=torch.bfloat16)
    call = L.decode_call(one["q_nope"], one["q_pe"], one["c_kv"], one["k_pe"], one["w_uk"], 0.1, 149)
    assert call.sparse_mode == 0 and call.atten_mask is None and call.actual_seq_lengths_kv == [150, 150]
    many = testing.make_mla_inputs(DECODE_SHAPES[1], dtype=torch.bfloat16)
    call = L.decode_call(many["q_nope"], many["q_pe"], many["c_kv"], many["k_pe"], many["w_uk"], 0.1,
                         torch.tensor([0, 5, 125]))
    assert call.sparse_mode == 3 and call.actual_seq_lengths_kv == [3, 8, 128] and call.actual_seq_lengths == [3] * 3
    with pytest.raises(VendorContractError):  # the vendor rejects a multi-query call without the mask
        kwargs = call.kwargs()
        kwargs["atten_mask"] = None
        AscendSemantics().npu_fused_infer_attention_score(*call.args(), **kwargs)


@pytest.mark.parametrize("change,needle", [
    (dict(H=16), "query heads"),
    (dict(T=17, S=40), "1..16"),
    (dict(C=256), "latent 512"),
    (dict(Dr=32), "rope 64"),
])
def test_decode_limits(change, needle):
    base = dict(B=1, T=1, S=8, H=32, Dn=8, Dr=64, Dv=8, C=512)
    base.update(change)
    shape = testing.MLAShape(**base)
    inputs = testing.make_mla_inputs(shape, dtype=torch.bfloat16)
    ok, why = mla.decode_limits(**inputs, scale=0.1, start_pos=shape.S - shape.T)
    assert not ok and needle in why


def test_decode_declines_fp32_and_cpu_tensors():
    inputs = testing.make_mla_inputs(DECODE_SHAPES[0], dtype=torch.float32)
    ok, why = mla.decode_limits(**inputs, scale=0.1, start_pos=149)
    assert not ok and "float32" in why
    ok, why = mla.KERNELS["mla_decode"].supports(**inputs, scale=0.1, start_pos=149)
    assert not ok and "npu" in why
