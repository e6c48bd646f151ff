"""RMSNorm's hand-written backward and RoPE's whole-row form are bitwise the textbook compositions.

The pretraining loss curve must not move when these get faster: each is compared, forward and gradients,
with torch.equal against the plain torch composition it replaced (written out here), differentiated by
autograd, in fp32, bf16 and fp64.
"""
from __future__ import annotations

import pytest
import torch

from glm5_core.model.norm import RMSNorm
from glm5_core.model.rope import apply_rope

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _textbook_rms_norm(x, weight, eps):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xc.to(x.dtype)


def _textbook_rope(x, cos, sin, interleave):
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleave:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _residual_block(normed, h, proj):
    """h + normed @ proj: h's gradient gathers the residual's and the norm's, as in a decoder layer."""
    return h + normed @ proj


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 9, 24), (5, 7)])
def test_rms_norm_forward_and_gradients_are_bitwise_autograds(dtype, shape):
    eps = 1e-6
    h0 = _randn(*shape, dtype=dtype, seed=1)
    w0 = 1 + 0.1 * _randn(shape[-1], dtype=dtype, seed=2)
    proj = _randn(shape[-1], shape[-1], dtype=dtype, seed=3)
    upstream = _randn(*shape, dtype=dtype, seed=4)

    h = h0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    expected = _residual_block(_textbook_rms_norm(h, w, eps), h, proj)
    expected.backward(upstream)

    norm = RMSNorm(shape[-1], eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(w0)
    h_ours = h0.clone().requires_grad_()
    got = _residual_block(norm(h_ours), h_ours, proj)
    got.backward(upstream)

    assert torch.equal(got, expected)
    assert torch.equal(h_ours.grad, h.grad)
    assert torch.equal(norm.weight.grad, w.grad)


def test_rms_norm_without_gradients_matches_the_composition():
    x = _randn(3, 16, dtype=torch.float32, seed=5)
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        assert torch.equal(norm(x), _textbook_rms_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("heads", [None, 3])
def test_rope_forward_and_gradient_are_bitwise_the_slice_formula(dtype, interleave, heads):
    B, T, R, extra = 2, 11, 8, 4
    lead = (B, T) if heads is None else (B, T, heads)
    base0 = _randn(*lead, extra + R, dtype=dtype, seed=6)  # rotated slice at the end, as q_pe in MLA
    cos, sin = _randn(B, T, R // 2, dtype=dtype, seed=7), _randn(B, T, R // 2, dtype=dtype, seed=8)
    upstream = _randn(*lead, R, dtype=dtype, seed=9)
    results = []
    for fn in (_textbook_rope, lambda x, c, s, i: apply_rope(x, c, s, interleave=i)):
        base = base0.clone().requires_grad_()
        out = fn(base[..., extra:], cos, sin, interleave)
        out.backward(upstream)
        results.append((out.detach(), base.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][0].signbit(), results[1][0].signbit())
    assert torch.equal(results[0][1], results[1][1])


def test_rms_norm_refuses_a_double_backward():
    """Its backward's ops do not carry the saved rsqrt's dependence on x: second derivatives would be wrong."""
    x = _randn(3, 8, dtype=torch.float32, seed=10).requires_grad_()
    (grad,) = torch.autograd.grad(RMSNorm(8, 1e-5)(x).pow(2).sum(), x, create_graph=False)
    assert grad.shape == x.shape
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(RMSNorm(8, 1e-5)(x).pow(2).sum(), x, create_graph=True)
