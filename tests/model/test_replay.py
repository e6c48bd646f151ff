"""Routing replay and DSA index replay in the model's forward: the replayed experts / keys are the ones used,
bit for bit; the router's gradients through replayed experts match a reference; bad replay tensors are refused."""
import pytest
import torch

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.model.moe import MoE
from glm5_core.ops import dsa
from glm5_core.ops import moe as moe_ops

B, T = 2, 40


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, max_position_embeddings=128)).eval()


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 264, (B, T), generator=torch.Generator().manual_seed(1))


def random_experts(shape, num_experts, seed):
    """Distinct expert ids per row: int64 [..., K]."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    scores = torch.rand(*lead, num_experts, generator=g)
    return scores.argsort(-1)[..., :k]


def random_causal_keys(B, T, F, K, seed):
    """Distinct key positions <= the query's position, -1 padded: int64 [B, T, F, K]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((B, T, F, K), -1, dtype=torch.int64)
    for t in range(T):
        n = min(K, t + 1)
        picks = torch.rand(B, F, t + 1, generator=g).argsort(-1)[..., :n]  # [B, F, n]
        out[:, t, :, :n] = picks
    return out


def test_replaying_its_own_choice_changes_nothing(model, input_ids):
    with torch.no_grad():
        free = model(input_ids)
        replayed = model(input_ids, routing_replay=torch.stack(free.expert_ids, 2),
                         index_replay=torch.stack(free.topk_idx, 2))
    assert torch.equal(free.logits, replayed.logits)


def test_routing_replay_uses_exactly_the_given_experts(model, input_ids):
    cfg = model.config
    forced = random_experts((B, T, 3, cfg.num_experts_per_tok), cfg.n_routed_experts, seed=2)
    forced[1, 5:9] = -1  # these rows are not replayed: the router chooses
    with torch.no_grad():
        free = model(input_ids)
        out = model(input_ids, routing_replay=forced)
    used = torch.stack(out.expert_ids, 2)  # [B, T, M, K]
    replayed = forced[..., 0] >= 0
    assert torch.equal(used[replayed], forced[replayed].to(torch.int32))
    assert not torch.equal(out.logits, free.logits)
    # the unreplayed rows at positions 5..8 follow the router; before position 5 everything is forced, so the
    # rows there are what a forward with those same experts forced selects: replay those and compare
    with torch.no_grad():
        again = model(input_ids, routing_replay=torch.where(forced >= 0, forced, used.long()))
    assert torch.equal(again.logits, out.logits)


def test_index_replay_attends_exactly_the_given_keys(model, input_ids, monkeypatch):
    cfg = model.config
    full = cfg.layer_indexer_types().count("full")
    forced = random_causal_keys(B, T, full, cfg.index_topk, seed=3)
    with torch.no_grad():
        out = model(input_ids, index_replay=forced)
    assert [t.tolist() for t in out.topk_idx] == [forced[:, :, f].tolist() for f in range(full)]
    # the same logits as a model whose indexer itself selected these keys (shared layers reuse them)
    calls = iter(range(full))

    def fake_topk(q, k, w, topk, *, start_pos=0, backend=None):
        return forced[:, :, next(calls)].to(torch.int32)

    monkeypatch.setattr(dsa, "indexer_topk", fake_topk)
    with torch.no_grad():
        selected = model(input_ids)
    assert torch.equal(selected.logits, out.logits)


def test_replay_off_is_the_plain_forward(model, input_ids):
    with torch.no_grad():
        a = model(input_ids)
        b = model(input_ids, routing_replay=None, index_replay=None)
    assert torch.equal(a.logits, b.logits)


def reference_moe(layer: MoE, x, ids):
    """The reference MoE with forced expert ids: weights from the unbiased sigmoid scores at ``ids``."""
    logits = x @ layer.gate.weight.T  # [N, E]
    scores = 1.0 / (1.0 + torch.exp(-logits))
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + moe_ops.RENORM_EPS) * layer.gate.scaling
    stacked = [torch.stack([getattr(e, name).weight for e in layer.experts])
               for name in ("gate_proj", "up_proj", "down_proj")]
    return moe_ops.fused_experts_reference(x, w, ids, *stacked) + layer.shared_experts(x)


def test_gradients_through_replayed_experts_match_the_reference_moe():
    torch.manual_seed(4)
    cfg = GLM5Config.tiny(hidden_size=16, moe_intermediate_size=8)
    layer = MoE(cfg, 0, backend="cpu").double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    N = 12
    x = torch.randn(1, N, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    ids = random_experts((N, cfg.num_experts_per_tok), cfg.n_routed_experts, seed=5)
    y, _, used = layer.route_and_run(x, ids.view(1, N, -1))
    assert torch.equal(used.view(N, -1), ids.to(torch.int32))
    params = [x, layer.gate.weight, layer.experts[int(ids[0, 0])].up_proj.weight]
    grads = torch.autograd.grad((y ** 2).sum(), params)
    ref = reference_moe(layer, x.view(N, -1), ids)
    ref_grads = torch.autograd.grad((ref ** 2).sum(), params)
    torch.testing.assert_close(y.view(N, -1), ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert grads[1].abs().sum() > 0  # the router learns through replayed experts


def test_route_weights_gradcheck():
    logits = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    ids = random_experts((6, 3), 8, seed=6).to(torch.int32)
    assert torch.autograd.gradcheck(
        lambda z: moe_ops.route_weights(z, ids, renormalize=True, routed_scaling_factor=2.5), (logits,))


def test_route_weights_equals_route_at_its_own_ids():
    logits = torch.randn(20, 8, dtype=torch.float64)
    weights, ids = moe_ops.route_reference(logits, None, top_k=2, renormalize=True, routed_scaling_factor=2.5)
    assert torch.equal(moe_ops.route_weights(logits, ids, renormalize=True, routed_scaling_factor=2.5), weights)


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.float(), "integer tensor"),
    (lambda r: r[:, :-1], "shape"),
    (lambda r: r.index_fill(0, torch.tensor([0]), 8), r"expert ids in \[0, 8\)"),
    (lambda r: r.index_fill(3, torch.tensor([1]), -1), "mixing"),
    (lambda r: torch.cat([r[..., :1], r[..., :1]], -1), "repeated"),
])
def test_bad_routing_replay_is_refused(model, input_ids, edit, match):
    cfg = model.config
    good = random_experts((B, T, 3, cfg.num_experts_per_tok), cfg.n_routed_experts, seed=7)
    with pytest.raises(ValueError, match=match):
        model(input_ids, routing_replay=edit(good))


def _future_key(r):
    r = r.clone()
    r[0, 3, 0, 0] = 10  # query 3 cannot see key 10
    return r


def _key_after_padding(r):
    r = r.clone()
    r[0, 2, 0, -1] = 0  # query 2 has 3 keys and 5 pads: a key after the pads
    return r


def _repeated_key(r):
    r = r.clone()
    r[0, 20, 0, 1] = r[0, 20, 0, 0]
    return r


@pytest.mark.parametrize("edit, match", [
    (_future_key, "causality"), (_key_after_padding, "padding"), (_repeated_key, "repeated"),
    (lambda r: r[..., :4], "shape"),
])
def test_bad_index_replay_is_refused(model, input_ids, edit, match):
    cfg = model.config
    good = random_causal_keys(B, T, cfg.layer_indexer_types().count("full"), cfg.index_topk, seed=8)
    with torch.no_grad():
        model(input_ids, index_replay=good)  # the unedited replay is accepted
    with pytest.raises(ValueError, match=match):
        model(input_ids, index_replay=edit(good))


def test_index_replay_needs_sparse_attention(model, input_ids):
    cfg = model.config
    good = random_causal_keys(B, T, cfg.layer_indexer_types().count("full"), cfg.index_topk, seed=9)
    with pytest.raises(ValueError, match="sparse"):
        model(input_ids, attention="dense", index_replay=good)
