"""model.hyper_connection against transformers 5.25's Glm5NextTextHyperConnection / HyperHead (the modules
themselves, weights copied), and the decoder layer's stream mix."""
from __future__ import annotations

import pytest
import torch

from glm5_core.model.hyper_connection import HyperConnection, HyperHead

glm5_next = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402


def _pair(hc_mult=3, hidden=10, iters=7, eps=1e-6, seed=0):
    cfg = Glm5NextTextConfig(hidden_size=hidden, hc_mult=hc_mult, hc_sinkhorn_iters=iters, hc_eps=eps,
                             rms_norm_eps=1e-5)
    theirs = glm5_next.Glm5NextTextHyperConnection(cfg)
    ours = HyperConnection(hidden_size=hidden, hc_mult=hc_mult, hc_sinkhorn_iters=iters, hc_eps=eps,
                           rms_norm_eps=1e-5, backend="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.fn.copy_(torch.randn(theirs.fn.shape, generator=g) * 0.3)
        theirs.base.copy_(torch.randn(theirs.base.shape, generator=g))
        theirs.scale.copy_(torch.rand(3, generator=g) + 0.5)
    missing = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return ours, theirs


def test_state_dict_names_and_shapes_match_transformers():
    ours, theirs = _pair()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert ours.base.dtype == ours.scale.dtype == torch.float32


def test_init_matches_transformers_rule():
    ours = HyperConnection(hidden_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    assert torch.equal(ours.base, torch.zeros(24)) and torch.equal(ours.scale, torch.ones(3))
    assert 0.01 < ours.fn.std().item() < 0.03


@pytest.mark.parametrize("hc_mult,hidden,iters", [(4, 16, 20), (3, 10, 1), (5, 7, 4)])
def test_forward_and_layer_mix_match_transformers_fp32(hc_mult, hidden, iters):
    ours, theirs = _pair(hc_mult, hidden, iters)
    x = torch.randn(2, 5, hc_mult, hidden, generator=torch.Generator().manual_seed(1))
    post, comb, collapsed = ours(x)
    t_post, t_comb, t_collapsed = theirs(x)
    torch.testing.assert_close(post, t_post, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(comb, t_comb, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(collapsed, t_collapsed, rtol=1e-6, atol=1e-6)
    out = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(2))
    ref = t_post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(t_comb.transpose(-1, -2), x)  # the layer's mix
    torch.testing.assert_close(ours.mix(x, out, post, comb), ref, rtol=1e-6, atol=1e-6)


def test_gradients_match_transformers_fp32():
    ours, theirs = _pair(4, 12, 5)
    x = torch.randn(3, 2, 4, 12, generator=torch.Generator().manual_seed(3))
    out = torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(4))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    post, comb, col = ours(xs[0])
    (ours.mix(xs[0], out * col, post, comb).square().sum()).backward()
    t_post, t_comb, t_col = theirs(xs[1])
    (t_post.unsqueeze(-1) * (out * t_col).unsqueeze(-2) + torch.matmul(t_comb.transpose(-1, -2), xs[1])
     ).square().sum().backward()
    # fp32 (transformers computes the weights in fp32 whatever the input): the cpu kernels' hand-written backwards
    # round in another order than autograd's chain
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)
    for name in ("fn", "base", "scale"):
        torch.testing.assert_close(getattr(ours, name).grad, getattr(theirs, name).grad, rtol=1e-4, atol=1e-5)


def test_head_is_transformers_mean():
    x = torch.randn(2, 3, 4, 6)
    assert torch.equal(HyperHead()(x), glm5_next.Glm5NextTextHyperHead()(x))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="hc_mult"):
        HyperConnection(hidden_size=8, hc_mult=0, hc_sinkhorn_iters=2, hc_eps=1e-6, rms_norm_eps=1e-6)
    hc = HyperConnection(hidden_size=8, hc_mult=2, hc_sinkhorn_iters=2, hc_eps=1e-6, rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match="streams"):
        hc(torch.randn(2, 3, 8))


@pytest.mark.parametrize("hc_mult,hidden,iters", [(4, 16, 20), (3, 10, 1), (5, 7, 4)])
@pytest.mark.parametrize("rows", [1, 40])
def test_no_grad_weights_are_bitwise_the_autograd_path(hc_mult, hidden, iters, rows):
    """Inference takes a shorter path (one affine, in-place Sinkhorn): the same bits as the path with gradients,
    at one row (a decode step) and many, under no_grad and inference_mode."""
    ours, _ = _pair(hc_mult, hidden, iters)
    x = torch.randn(rows, hc_mult, hidden, generator=torch.Generator().manual_seed(5)) * 3
    want = ours(x)  # parameters require grad: the autograd path
    assert all(t.requires_grad for t in want[:2])
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = ours(x)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b.detach())
