"""The MLA reference: expanded and absorbed forms agree, and both equal a naive per-head loop."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import mla

SHAPES = testing.MLA_SHAPES + (testing.MLAShape(B=2, T=3, S=11, H=5, Dn=7, Dr=3, Dv=9, C=13),)


def naive_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, positions):
    """Loop over (b, t, h): explicit keys, values and causal softmax."""
    B, T, H, _ = q_nope.shape
    out = torch.zeros(B, T, H, w_uv.shape[1], dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            visible = int(positions[b][t]) + 1
            for h in range(H):
                keys = c_kv[b, :visible] @ w_uk[h].T  # [s, Dn]
                values = c_kv[b, :visible] @ w_uv[h].T  # [s, Dv]
                logits = (keys @ q_nope[b, t, h] + k_pe[b, :visible] @ q_pe[b, t, h]) * scale
                out[b, t, h] = torch.softmax(logits, 0) @ values
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("start_mode", ["first", "last", "ragged"])
def test_expanded_and_absorbed_agree_in_fp64(shape, start_mode):
    if start_mode == "first" and shape.S < shape.T:
        pytest.skip("not a valid layout")
    x = testing.make_mla_inputs(shape, dtype=torch.float64, seed=3)
    start = testing.start_positions_for(shape.B, shape.T, shape.S, start_mode)
    scale = (shape.Dn + shape.Dr) ** -0.5
    expanded = mla.prefill(**x, scale=scale, start_pos=start)
    absorbed = mla.decode(**x, scale=scale, start_pos=start)
    assert (expanded - absorbed).abs().max() <= 1e-10
    positions = query_positions(start, shape)
    assert torch.allclose(expanded, naive_attention(**x, scale=scale, positions=positions), atol=1e-12, rtol=0)


def query_positions(start, shape):
    if isinstance(start, torch.Tensor):
        return [[int(start[b]) + t for t in range(shape.T)] for b in range(shape.B)]
    return [[start + t for t in range(shape.T)] for _ in range(shape.B)]


def test_decode_default_start_is_last_slots():
    shape = SHAPES[1]
    x = testing.make_mla_inputs(shape, dtype=torch.float64)
    assert torch.equal(mla.decode(**x, scale=0.5), mla.decode(**x, scale=0.5, start_pos=shape.S - shape.T))


def test_cache_tail_beyond_the_query_is_ignored():
    shape = testing.MLAShape(B=1, T=1, S=9, H=2, Dn=4, Dr=2, Dv=4, C=8)
    x = testing.make_mla_inputs(shape, dtype=torch.float64)
    out = mla.decode(**x, scale=0.5, start_pos=4)
    x["c_kv"][:, 5:] = 1e3  # garbage past position 4
    x["k_pe"][:, 5:] = -1e3
    assert torch.equal(out, mla.decode(**x, scale=0.5, start_pos=4))


def test_reduced_precision_returns_input_dtype_and_stays_close():
    shape = SHAPES[2]
    x = testing.make_mla_inputs(shape, dtype=torch.bfloat16)
    out = mla.prefill(**x, scale=0.3)
    exact = mla.prefill(**{k: v.double() for k, v in x.items()}, scale=0.3)
    assert out.dtype == torch.bfloat16
    assert (out.double() - exact).abs().max() < 2e-2


def test_gradients_flow_through_both_forms():
    shape = testing.MLAShape(B=1, T=3, S=4, H=2, Dn=3, Dr=2, Dv=3, C=4)
    x = testing.make_mla_inputs(shape, dtype=torch.float64)
    args = tuple(v.requires_grad_() for v in x.values())
    assert torch.autograd.gradcheck(lambda *a: mla.prefill(*a, scale=0.7, start_pos=1), args)
    assert torch.autograd.gradcheck(lambda *a: mla.decode(*a, scale=0.7, start_pos=1), args)


@pytest.mark.parametrize("entry", [mla.prefill, mla.decode], ids=["prefill", "decode"])
def test_empty_batch_with_ragged_start_positions(entry):
    """B=0 with an int start works; a [0] start_pos tensor used to fail in validation (min() of an empty tensor)."""
    x = testing.make_mla_inputs(testing.MLAShape(B=0, T=2, S=5, H=2, Dn=3, Dr=2, Dv=3, C=4))
    out = entry(**x, scale=0.5, start_pos=torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 2, 2, 3)
    assert torch.equal(out, entry(**x, scale=0.5, start_pos=3))
