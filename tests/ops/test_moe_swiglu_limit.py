"""GLM-5.3's clamped SwiGLU (``swiglu_limit``) in the MoE experts: the reference against transformers 5.25's
Glm5NextTextExperts / Glm5NextTextMLP (the modules, weights copied), its gradients (gradcheck, the clamps' ends),
and the default (no limit) unchanged bit for bit."""
from __future__ import annotations

import pytest
import torch

from glm5_core.model.mlp import MLP
from glm5_core.ops import moe
from tests.ops import swiglu_limit_cases as cases

glm5_next = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402


def _config(limit):
    return Glm5NextTextConfig(hidden_size=cases.D, moe_intermediate_size=cases.F, intermediate_size=cases.F,
                              num_local_experts=cases.E, n_routed_experts=cases.E, swiglu_limit=limit)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fused_experts_reference_matches_transformers_experts(dtype):
    x = cases.inputs(dtype)
    theirs = glm5_next.Glm5NextTextExperts(_config(cases.LIMIT)).to(dtype)
    with torch.no_grad():
        theirs.gate_up_proj.copy_(torch.cat([x["w_gate"], x["w_up"]], dim=1))  # [E, 2F, D]: gate rows, then up
        theirs.down_proj.copy_(x["w_down"])
    want = theirs(x["x"], x["expert_ids"].long(), x["weights"])
    got = moe.fused_experts_reference(x["x"], x["weights"], x["expert_ids"], x["w_gate"], x["w_up"], x["w_down"],
                                      swiglu_limit=cases.LIMIT)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got, want, **tol)
    unclamped = moe.fused_experts_reference(x["x"], x["weights"], x["expert_ids"], x["w_gate"], x["w_up"],
                                            x["w_down"])
    assert not torch.allclose(unclamped, want), "the inputs must reach the clamp"


def test_mlp_matches_transformers_mlp_forward_and_backward():
    theirs = glm5_next.Glm5NextTextMLP(_config(cases.LIMIT)).double()
    ours = MLP(cases.D, cases.F, swiglu_limit=cases.LIMIT).double()
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items()}, strict=True)
    x = cases.inputs()["x"] * 3
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    got, want = ours(xs[0]), theirs(xs[1])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.gate_proj.weight.grad, theirs.gate_proj.weight.grad, rtol=1e-12, atol=1e-12)


def test_clamp_gradient_at_the_ends_is_torchs():
    """At gate == L and up == +-L exactly the gradient passes (torch's clamp backward), zero beyond."""
    L = cases.LIMIT
    gate = torch.tensor([L, L + 0.5, -3.0, 0.2], dtype=torch.float64, requires_grad=True)
    up = torch.tensor([L, -L, -L - 0.1, L + 0.1], dtype=torch.float64, requires_grad=True)
    moe.swiglu(gate, up, L).sum().backward()
    assert gate.grad[0] != 0 and gate.grad[1] == 0 and gate.grad[2] != 0
    assert up.grad[0] != 0 and up.grad[1] != 0 and up.grad[2] == 0 and up.grad[3] == 0


def test_experts_reference_gradcheck():
    x = cases.sorted_inputs(cases.inputs())
    leaves = {k: x[k].clone().requires_grad_() for k in ("x_sorted", "w_gate", "w_up", "w_down")}
    # moved off the exact ends (finite differences straddle a kink there); test_clamp_gradient_at_the_ends covers them
    with torch.no_grad():
        leaves["w_gate"][:, 0, 0] += 0.01
        leaves["w_up"][:, 1:3, 0] *= 0.9

    def f(x_sorted, w_gate, w_up, w_down):
        return moe.experts_reference(x_sorted, x["counts"], w_gate, w_up, w_down, swiglu_limit=cases.LIMIT)

    assert torch.autograd.gradcheck(f, tuple(leaves.values()))


def test_no_limit_is_the_unclamped_call_bitwise():
    x = cases.inputs(torch.float32)
    args = (x["x"], x["weights"], x["expert_ids"], x["w_gate"], x["w_up"], x["w_down"])
    assert torch.equal(moe.fused_experts(*args, swiglu_limit=None, backend="cpu"), moe.fused_experts(*args,
                                                                                                     backend="cpu"))


@pytest.mark.parametrize("bad,error", [(0.0, ValueError), (-1.0, ValueError), ("10", TypeError),
                                       (float("nan"), ValueError)])
def test_bad_limit_is_named(bad, error):
    x = cases.inputs(torch.float32)
    with pytest.raises(error, match="swiglu_limit"):
        moe.fused_experts(x["x"], x["weights"], x["expert_ids"], x["w_gate"], x["w_up"], x["w_down"],
                          swiglu_limit=bad)
