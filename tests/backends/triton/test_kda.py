"""KDA's Triton kernels (the fused recurrence, the causal conv and its step) against the references, on small
shapes (under the interpreter without a GPU)."""
import pytest
import torch

from glm5_core import testing
from glm5_core.ops import kda
from tests.backends.triton.helpers import assert_close, kernel

SHAPES = (testing.KDAShape(2, 9, 2, 16, 8), testing.KDAShape(1, 3, 1, 8, 40), testing.KDAShape(1, 1, 3, 12, 4))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["kda_recurrent", "kda_chunked"])
def test_recurrence_matches_reference(op, shape, dtype, device):
    """V = 40 spans two BV = 32 column blocks; K = 12 is not a power of two (masked rows)."""
    x = testing.make_kda_inputs(shape, dtype=dtype, device=device, seed=3)
    o, s = kernel(op)(**x, output_final_state=True, use_qk_l2norm=True)
    ro, rs = kda.recurrent_reference(**x, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close(o, ro, dtype, "output")
    assert_close(s, rs, torch.float32 if dtype == torch.float32 else dtype, "state")


def test_recurrence_without_state_or_l2norm(device):
    x = testing.make_kda_inputs(SHAPES[0], device=device, seed=4, initial_state=False)
    o, s = kernel("kda_recurrent")(**x, output_final_state=False, use_qk_l2norm=False, scale=0.3)
    ro, _ = kda.recurrent_reference(**x, use_qk_l2norm=False, scale=0.3)
    assert s is None
    assert_close(o, ro, torch.float32, "output")


@pytest.mark.parametrize("with_state", [True, False])
def test_conv_matches_reference(with_state, device):
    shape = testing.KDAShape(2, 19, 2, 16, 8)  # D = 96: two channel blocks, T = 19: two token blocks
    c = testing.make_conv_inputs(shape, device=device, seed=5, conv_state=with_state)
    out, state = kernel("kda_causal_conv")(**c, output_final_state=True)
    ref, ref_state = kda.causal_conv_reference(**c, output_final_state=True)
    assert_close(out, ref, torch.float32, "out")
    assert torch.equal(state, ref_state)
    step, step_state = kernel("kda_causal_conv_update")(c["x"][:, 0], ref_state, c["weight"])
    ref_step, ref_step_state = kda.causal_conv_update_reference(c["x"][:, 0], ref_state, c["weight"])
    assert_close(step, ref_step, torch.float32, "step")
    assert torch.equal(step_state, ref_step_state)


def test_kernels_decline_fp64_and_wide_heads(device):
    x = testing.make_kda_inputs(testing.KDAShape(1, 2, 1, 4, 4), dtype=torch.float64, device=device)
    ok, why = kernel("kda_recurrent").supports(**x)
    assert not ok and "fp64" in why
    wide = testing.make_kda_inputs(testing.KDAShape(1, 1, 1, 512, 4), device=device)
    ok, why = kernel("kda_chunked").supports(**wide)
    assert not ok and "K=512" in why
