"""KimiDeltaAttention (glm5_core.model.linear_attention) against transformers' Glm5NextTextLinearAttention itself
(transformers 5.25, models/glm5_next), weights copied: state-dict keys, fp32 outputs, the lower-bound and softplus
gates, padding masks, prefill then decode against transformers' longer prefill, gradients."""
import pytest
import torch

from glm5_core.model.linear_attention import KDAState, KimiDeltaAttention, state_bytes

M = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
C = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")


def _pair(lower_bound=-5.0, seed=0, chunk_size=16):
    cfg = C.Glm5NextTextConfig(hidden_size=24, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
                               linear_lower_bound=lower_bound, num_hidden_layers=4)
    torch.manual_seed(seed)
    theirs = M.Glm5NextTextLinearAttention(cfg, 0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
        theirs.forget_gate.A_log.uniform_(-1.0, 1.0)
        theirs.o_norm.weight.uniform_(0.5, 1.5)
    ours = KimiDeltaAttention.from_config(cfg, chunk_size=chunk_size)
    ours.load_state_dict(theirs.state_dict())  # strict: the same keys and shapes
    return cfg, theirs.eval(), ours.eval()


def _x(B=2, T=37, seed=1):
    return torch.randn(B, T, 24, generator=torch.Generator().manual_seed(seed))


def test_state_dict_keys_and_shapes_match_transformers():
    _, theirs, ours = _pair()
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert ours.conv1d.weight.dtype == torch.float32


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
def test_forward_matches_transformers_fp32(lower_bound):
    """T = 37 with chunks of 16 (a partial last chunk): within 1e-5 of the largest output."""
    _, theirs, ours = _pair(lower_bound)
    x = _x()
    with torch.no_grad():
        want = theirs(x)
        got, state = ours(x)
    assert state is None
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)


def test_padding_mask_matches_transformers():
    _, theirs, ours = _pair(seed=2)
    x = _x(T=9, seed=3)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = theirs(x, attention_mask=mask)
        got, _ = ours(x, attention_mask=mask)
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)


def test_prefill_then_decode_matches_transformers_longer_prefill():
    """Ours: prefill T = 21 (use_cache), then 4 one-token decode steps (conv update, recurrent KDA); transformers:
    one pass over all 25 tokens. The decoded tokens' outputs agree in fp32."""
    _, theirs, ours = _pair(seed=4)
    x = _x(T=25, seed=5)
    with torch.no_grad():
        want = theirs(x)
        out, state = ours(x[:, :21], use_cache=True)
        assert isinstance(state, KDAState) and state.recurrent_state.dtype == torch.float32
        steps = []
        for t in range(21, 25):
            o, state = ours(x[:, t:t + 1], state)
            steps.append(o)
    got = torch.cat([out, *steps], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)
    assert state.nbytes() == state_bytes(batch_size=2, linear_num_heads=2, linear_head_dim=8,
                                         linear_conv_kernel_dim=4)


def test_chunked_continuation_from_a_state_equals_one_pass():
    """fp64: prefill 10, then 15 more tokens in one chunked call from the state, equals one pass of 25."""
    _, _, ours = _pair(seed=6)
    ours = ours.double()
    x = _x(T=25, seed=7).double()
    with torch.no_grad():
        whole, s_whole = ours(x, use_cache=True)
        a, s = ours(x[:, :10], use_cache=True)
        b, s = ours(x[:, 10:], s)
    torch.testing.assert_close(torch.cat([a, b], 1), whole, atol=1e-10, rtol=0)
    torch.testing.assert_close(s.recurrent_state, s_whole.recurrent_state, atol=1e-10, rtol=0)
    assert torch.equal(s.conv_state, s_whole.conv_state)


def test_gradients_reach_every_parameter_and_match_gradcheck():
    _, _, ours = _pair(seed=8, chunk_size=4)
    ours = ours.double()
    x = _x(B=1, T=6, seed=9).double().requires_grad_()
    out, _ = ours(x)
    out.square().sum().backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    small = KimiDeltaAttention(hidden_size=4, linear_num_heads=1, linear_head_dim=2, chunk_size=2).double()
    with torch.no_grad():
        for p in small.parameters():
            p.normal_(0, 0.5)
    xs = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: small(t)[0], (xs,))


def test_errors_name_the_argument():
    _, _, ours = _pair()
    with pytest.raises(ValueError, match="^hidden: expected"):
        ours(torch.randn(2, 3, 7))
    bad = ours.init_state(2)
    bad.recurrent_state = bad.recurrent_state[:, :1]
    with pytest.raises(ValueError, match="^state.recurrent_state: expected"):
        ours(_x(T=1), bad)
    with pytest.raises(ValueError, match="^linear_lower_bound"):
        KimiDeltaAttention(hidden_size=8, linear_num_heads=1, linear_head_dim=4, linear_lower_bound=1.0)
    with pytest.raises(ValueError, match="^hidden_act"):
        KimiDeltaAttention(hidden_size=8, linear_num_heads=1, linear_head_dim=4, hidden_act="gelu")


def test_bf16_layer_keeps_an_fp32_state():
    layer = KimiDeltaAttention(hidden_size=16, linear_num_heads=2, linear_head_dim=8).to(torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    out, state = layer(x, use_cache=True)
    step, state = layer(x[:, :1], state)
    assert out.dtype == step.dtype == torch.bfloat16
    assert state.conv_state.dtype == state.recurrent_state.dtype == torch.float32
    assert state.conv_state.shape == (2, 3, 48) and state.recurrent_state.shape == (2, 2, 8, 8)


def test_decode_step_calls_the_bound_kernels_as_the_entry_points_would(monkeypatch):
    """A decode step calls its two KDA kernels through the binding directly (no entry-point checks): the same bits
    as through ``kda.causal_conv_update`` / ``kda.recurrent`` with the layer's arguments; a state on another device
    (the one check the entry points made that the layer's own state check did not) is still refused."""
    from glm5_core import registry
    from glm5_core.model import linear_attention
    from glm5_core.ops import kda

    _, _, ours = _pair()
    state = ours(_x(T=5), use_cache=True)[1]
    x = _x(T=1, seed=3)
    with torch.no_grad():
        got, got_state = ours(x, KDAState(state.conv_state.clone(), state.recurrent_state.clone()))

    class _ThroughEntryPoints:
        """registry.call, with the layer's two decode ops replaced by the entry-point calls the layer made before
        (their arguments written out here: the layer's own keyword arguments are not used)."""

        @staticmethod
        def call(op, *args, backend=None, **kwargs):
            if op == "kda_causal_conv_update":
                x, conv_state, weight = args[:3]
                return kda.causal_conv_update(x, conv_state, weight, activation="silu", backend=backend)
            if op == "kda_recurrent":
                return kda.recurrent(*args[:5], initial_state=kwargs["initial_state"], output_final_state=True,
                                     use_qk_l2norm=True, backend=backend)
            return registry.call(op, *args, backend=backend, **kwargs)

    monkeypatch.setattr(linear_attention, "registry", _ThroughEntryPoints)
    with torch.no_grad():
        want, want_state = ours(x, KDAState(state.conv_state.clone(), state.recurrent_state.clone()))
    assert torch.equal(got, want)
    assert torch.equal(got_state.conv_state, want_state.conv_state)
    assert torch.equal(got_state.recurrent_state, want_state.recurrent_state)
    with pytest.raises(ValueError, match="^state.conv_state: expected .* on cpu, got .* on meta"):
        ours(x, KDAState(state.conv_state.to("meta"), state.recurrent_state))
