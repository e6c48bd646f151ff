"""Clamped-SwiGLU (GLM-5.3's ``swiglu_limit``) expert inputs shared by the reference and backend tests: the
gate / up projections spread far past the limit, and rows that land exactly on +-L (the clamp's ends, where
torch's clamp passes the gradient)."""
from __future__ import annotations

import torch

from glm5_core.ops import moe

N, D, F, E, K = 13, 6, 5, 4, 2
LIMIT = 1.5


def inputs(dtype: torch.dtype = torch.float64, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64) * 2.0
    w_gate = torch.randn(E, F, D, generator=g, dtype=torch.float64)
    w_up = torch.randn(E, F, D, generator=g, dtype=torch.float64)
    w_down = torch.randn(E, D, F, generator=g, dtype=torch.float64) * 0.5
    # token 0 (one-hot input) gets projections equal to a column of the weights: set some to exactly +-L
    x[0] = 0.0
    x[0, 0] = 1.0
    w_gate[:, 0, 0] = LIMIT
    w_up[:, 1, 0] = -LIMIT
    w_up[:, 2, 0] = LIMIT
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int32)
    weights = torch.rand(N, K, generator=g, dtype=torch.float64) + 0.5
    out = dict(x=x, weights=weights, w_gate=w_gate, w_up=w_up, w_down=w_down)
    return {**{k: v.to(dtype).to(device) for k, v in out.items()}, "expert_ids": ids.to(device)}


def sorted_inputs(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``experts`` op's inputs (expert-sorted rows and counts) of the same tokens."""
    x_sorted, _, counts = moe.dispatch_reference(x["x"], x["expert_ids"], num_experts=E)
    return dict(x_sorted=x_sorted, counts=counts, w_gate=x["w_gate"], w_up=x["w_up"], w_down=x["w_down"])


def check_backend(op: str, backend: str, dtype: torch.dtype, device: str = "cpu", *, tol: float) -> None:
    """The backend's kernel for ``op`` (moe_experts / moe_fused_experts) runs with the limit (no reference
    fallback) and matches the reference, forward and the gradients of every float input (the clamps' included)."""
    from glm5_core import registry

    x = inputs(dtype, device)
    if op == "moe_experts":
        x = sorted_inputs(x)
        entry, ref = moe.experts, moe.experts_reference
        floats = ("x_sorted", "w_gate", "w_up", "w_down")
    else:
        entry, ref = moe.fused_experts, moe.fused_experts_reference
        floats = ("x", "weights", "w_gate", "w_up", "w_down")

    def run(fn, **kw):
        leaves = {k: (v.detach().clone().requires_grad_() if k in floats else v) for k, v in x.items()}
        out = fn(**leaves, swiglu_limit=LIMIT, **kw)
        out.double().square().sum().backward()
        return out, {k: leaves[k].grad for k in floats}

    with registry.record_reference_runs() as log:
        out, grads = run(entry, backend=backend)
    assert not log, log
    want, want_grads = run(ref)
    torch.testing.assert_close(out.double(), want.double(), rtol=tol, atol=tol)
    for k in floats:
        torch.testing.assert_close(grads[k].double(), want_grads[k].double(), rtol=tol, atol=tol,
                                   msg=lambda m, k=k: f"d{k}: {m}")
