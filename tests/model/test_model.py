"""Model semantics: RoPE, MLA weight views, MoE routing, MTP, indexer losses and their gradient isolation."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from glm5_core.model import indexer_loss
from glm5_core.model.moe import MoE
from glm5_core.model.rope import RotaryEmbedding, apply_rope, positions_of


def _ids(cfg, B=2, T=14, seed=5):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- RoPE ------------------------------------------------------------------------------------------------
def test_interleaved_rope_is_complex_rotation_of_adjacent_pairs():
    rope = RotaryEmbedding(6, theta=100.0)
    pos = positions_of(3, 2, 5, torch.device("cpu"))
    cos, sin = rope(pos, torch.float64)
    x = torch.randn(2, 5, 4, 6, dtype=torch.float64)
    z = torch.view_as_complex(x.view(2, 5, 4, 3, 2))  # pairs (x[2i], x[2i+1])
    angles = pos.double().unsqueeze(-1) * 100.0 ** (-torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    expected = torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles).unsqueeze(2)).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos, sin, interleave=True), expected)
    halves = x.view(2, 5, 4, 3, 2).transpose(-1, -2).flatten(-2)  # the same pairs laid out as halves
    torch.testing.assert_close(apply_rope(halves, cos, sin, interleave=False),
                               expected.view(2, 5, 4, 3, 2).transpose(-1, -2).flatten(-2))


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(8, theta=50.0)
    q, k = torch.randn(1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 8, dtype=torch.float64)

    def score(pq, pk):
        cq, sq = rope(torch.tensor([[pq]]), torch.float64)
        ck, sk = rope(torch.tensor([[pk]]), torch.float64)
        return (apply_rope(q, cq, sq, interleave=True) * apply_rope(k, ck, sk, interleave=True)).sum()

    torch.testing.assert_close(score(7, 3), score(24, 20))
    assert not torch.allclose(score(7, 3), score(7, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_keeps_exact_rope_angles(dtype, make_model, make_config, tmp_path):
    """A bf16 / fp16 model's cos / sin are the exact angles rounded once to its dtype, at every position:
    the frequencies stay fp32 through model.to(dtype) and load_pretrained (a half-precision inv_freq turns
    position p by up to p * inv_freq * 2^-9 too far)."""
    from glm5_core.model import load_pretrained, save_pretrained

    cfg = make_config(max_position_embeddings=4096)
    cast = make_model(cfg, torch.float32).to(dtype)
    save_pretrained(cast, tmp_path)
    pos = torch.arange(cfg.max_position_embeddings).view(1, -1)  # [1, T]
    exact = pos.double().unsqueeze(-1) * cfg.rope_theta ** (
        -torch.arange(0, cfg.qk_rope_head_dim, 2, dtype=torch.float64) / cfg.qk_rope_head_dim)  # [1, T, Dr/2]
    one_rounding = torch.finfo(dtype).eps  # |cos| <= 1: one rounding moves it by at most eps / 2
    for model in (cast, load_pretrained(tmp_path)):
        cos, sin = model.model.rotary(pos, dtype)
        assert cos.dtype == dtype
        assert (cos.double() - exact.cos()).abs().max() <= one_rounding
        assert (sin.double() - exact.sin()).abs().max() <= one_rounding


# ---- MLA --------------------------------------------------------------------------------------------------
def test_absorbed_weights_are_views_of_kv_b_proj(small_model):
    attn = small_model.model.layers[0].self_attn
    cfg = small_model.config
    w_uk, w_uv = attn.absorbed_weights()
    assert w_uk.shape == (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank)
    assert w_uv.shape == (cfg.num_attention_heads, cfg.v_head_dim, cfg.kv_lora_rank)
    assert w_uk.data_ptr() == attn.kv_b_proj.weight.data_ptr()
    head1 = attn.kv_b_proj.weight[cfg.qk_nope_head_dim + cfg.v_head_dim:][:cfg.qk_nope_head_dim]  # head 1 rows
    assert torch.equal(w_uk[1], head1)


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_logits_are_causal(small_model, attention):
    ids = _ids(small_model.config, T=15)
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % small_model.config.vocab_size
    with torch.no_grad():
        a, b = small_model(ids, attention=attention).logits, small_model(changed, attention=attention).logits
    # not bitwise: the changed token moves rows between experts, so expert GEMMs see other row counts
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-12, rtol=1e-12)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


# ---- MoE --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("groups", [(1, 1), (3, 2)])
def test_moe_matches_every_expert_on_every_token(groups, make_model, make_config):
    n_group, topk_group = groups
    cfg = make_config(n_group=n_group, topk_group=topk_group)
    model = make_model(cfg)
    moe = model.model.layers[1].mlp
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.3, cfg.n_routed_experts))
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64)
    flat = x.view(18, -1)
    with torch.no_grad():
        weights, ids = moe.gate(flat)
        logits = F.linear(flat, moe.gate.weight)
        export_weights, export_ids = moe.gate.route_for_export(logits)
        y, counts = moe(x)
        dense, dense_counts = moe._all_experts(flat, weights, ids)
    assert torch.equal(export_ids, ids)
    torch.testing.assert_close(export_weights, weights)
    torch.testing.assert_close(y.view(18, -1), dense + moe.shared_experts(flat))
    assert torch.equal(counts, dense_counts) and int(counts.sum()) == 18 * cfg.num_experts_per_tok


def test_selection_bias_chooses_experts_but_weights_use_unbiased_scores(make_model, make_config):
    cfg = make_config()
    model = make_model(cfg)
    moe = model.model.layers[1].mlp
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 50.0, 50.0]))
        x = torch.randn(1, 7, cfg.hidden_size, dtype=torch.float64)
        y, counts = moe(x)
        flat = x.view(7, -1)
        scores = torch.sigmoid(flat @ moe.gate.weight.T)[:, 4:6]  # [7, 2] unbiased scores of experts 4, 5
        w = scores / scores.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        expected = w[:, :1] * moe.experts[4](flat) + w[:, 1:] * moe.experts[5](flat) + moe.shared_experts(flat)
    assert counts.tolist() == [0, 0, 0, 0, 7, 7]
    torch.testing.assert_close(y.view(7, -1), expected)


def test_expert_counts_rows_follow_router_biases(small_model):
    cfg = small_model.config
    ids = _ids(cfg, T=11)
    with torch.no_grad():
        plain = small_model(ids)
        with_mtp = small_model(ids, mtp_depths=3)
    rows = len(small_model.router_biases())
    assert rows == (cfg.num_hidden_layers - cfg.first_k_dense_replace) + 1  # + the MTP layer's MoE
    assert plain.expert_counts.shape == (rows, cfg.n_routed_experts) and plain.expert_counts.dtype == torch.int64
    per_layer = 2 * 11 * cfg.num_experts_per_tok
    assert plain.expert_counts[:-1].sum(-1).tolist() == [per_layer] * (rows - 1)
    assert plain.expert_counts[-1].sum() == 0 and with_mtp.expert_counts[-1].sum() == 3 * per_layer


def test_update_router_biases_moves_against_the_load(small_model):
    cfg = small_model.config
    rows = len(small_model.router_biases())
    counts = torch.zeros(rows, cfg.n_routed_experts, dtype=torch.int64)
    counts[:, 0] = 30  # expert 0 overloaded, the rest idle
    small_model.update_router_biases(counts, gamma=0.01)
    for bias in small_model.router_biases():
        assert bias.dtype == torch.float32
        assert bias[0].item() == pytest.approx(-0.01) and torch.allclose(bias[1:], torch.full_like(bias[1:], 0.01))
    with pytest.raises(ValueError, match="expert_counts"):
        small_model.update_router_biases(counts[:1], gamma=0.01)


# ---- MTP --------------------------------------------------------------------------------------------------
def test_mtp_depth_d_sees_tokens_up_to_t_plus_d(small_model):
    cfg = small_model.config
    ids = _ids(cfg, T=12)
    t, depths = 4, 3
    with torch.no_grad():
        base = small_model(ids, mtp_depths=depths).mtp_logits
        assert len(base) == depths and all(m.shape == (2, 12, cfg.vocab_size) for m in base)
        for d in range(1, depths + 1):
            later, visible = ids.clone(), ids.clone()
            later[:, t + d + 1] = (later[:, t + d + 1] + 1) % cfg.vocab_size
            visible[:, t + d] = (visible[:, t + d] + 1) % cfg.vocab_size
            torch.testing.assert_close(small_model(later, mtp_depths=depths).mtp_logits[d - 1][:, t], base[d - 1][:, t],
                                       atol=1e-12, rtol=1e-12)
            assert not torch.allclose(small_model(visible, mtp_depths=depths).mtp_logits[d - 1][:, t],
                                      base[d - 1][:, t])


def test_mtp_is_one_module_shared_across_depths(small_model):
    names = [n for n, _ in small_model.named_parameters() if ".eh_proj." in n]
    assert names == [f"model.layers.{small_model.config.num_hidden_layers}.eh_proj.weight"]


# ---- indexer losses -----------------------------------------------------------------------------------------
def test_kl_and_recall_on_hand_computed_cases():
    target = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)  # [1, 2, 3]
    scores = torch.tensor([[[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    # query 0: q = (1/2, 1/2) equals p -> 0; query 1: p = (1,0,0), q uniform over 3 -> log 3
    assert indexer_loss.dense_kl(target, scores).item() == pytest.approx(math.log(3) / 2)
    topk = torch.tensor([[[1, 0], [0, 2]]], dtype=torch.int32)
    # query 0 restricted to {1, 0}: p = (1/2, 1/2), q = (1/2, 1/2) -> 0; query 1 on {0, 2}: p = (1, 0), q = (1/2, 1/2)
    assert indexer_loss.sparse_kl(target, scores, topk).item() == pytest.approx(math.log(2) / 2)
    assert indexer_loss.topk_recall(target, torch.tensor([[[1, -1], [2, -1]]])).item() == pytest.approx(0.25)


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_indexer_learns_only_from_kl_and_model_only_from_lm_loss(attention, make_model, make_config):
    model = make_model(make_config()).train()
    ids = _ids(model.config, T=13)
    out = model(ids, attention=attention, indexer_loss=True, mtp_depths=1)
    assert out.indexer_kl.item() > 0 and 0 < out.topk_recall.item() <= 1
    indexer = {id(p) for p in model.indexer_parameters()}
    assert indexer and all(".indexer." in n for n, p in model.named_parameters() if id(p) in indexer)
    params = [p for p in model.parameters()]
    kl_grads = torch.autograd.grad(out.indexer_kl, params, retain_graph=True, allow_unused=True)
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    lm_grads = torch.autograd.grad(lm, params, allow_unused=True)
    for p, g_kl, g_lm in zip(params, kl_grads, lm_grads):
        if id(p) in indexer:
            assert g_lm is None or not g_lm.any()
        else:
            assert g_kl is None or not g_kl.any()
    assert any(g is not None and g.any() for p, g in zip(params, kl_grads) if id(p) in indexer)
    gate = model.model.layers[1].mlp.gate.weight  # the router learns from the LM loss through the weights
    assert lm_grads[next(i for i, p in enumerate(params) if p is gate)].any()


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_forward_without_logits_gives_the_same_indexer_signals(attention, make_model, make_config):
    """return_logits=False (the indexer warm-up) skips the lm_head, main and MTP: no logits, and the KL, recall,
    expert counts, selected keys and the KL's indexer gradients exactly as with them."""
    model = make_model(make_config()).train()
    ids = _ids(model.config, T=13)
    calls = []
    model.lm_head.register_forward_hook(lambda *args: calls.append(1))
    runs = {}
    for flag in (True, False):
        out = model(ids, attention=attention, indexer_loss=True, mtp_depths=2, return_logits=flag)
        grads = torch.autograd.grad(out.indexer_kl, list(model.indexer_parameters()))
        runs[flag] = out, grads
    (full, full_grads), (bare, bare_grads) = runs[True], runs[False]
    assert len(calls) == 3  # the main head and two MTP depths, in the run with logits only
    assert bare.logits is None and bare.mtp_logits == [] and full.logits is not None and len(full.mtp_logits) == 2
    for name in ("indexer_kl", "topk_recall", "expert_counts", "hidden"):
        assert torch.equal(getattr(full, name), getattr(bare, name)), name
    assert all(torch.equal(a, b) for a, b in zip(full.topk_idx, bare.topk_idx))
    assert all(torch.equal(a, b) for a, b in zip(full_grads, bare_grads))


def test_sparse_kl_equals_dense_kl_and_recall_is_one_when_topk_covers_all_keys(make_model, make_config):
    model = make_model(make_config(index_topk=32))
    ids = _ids(model.config, T=13)
    with torch.no_grad():
        dense = model(ids, attention="dense", indexer_loss=True)
        sparse = model(ids, attention="sparse", indexer_loss=True)
    torch.testing.assert_close(sparse.indexer_kl, dense.indexer_kl)
    assert sparse.topk_recall.item() == pytest.approx(1.0) and dense.topk_idx == []


def test_topk_recall_below_one_when_sparse_drops_keys(small_model):
    with torch.no_grad():
        out = small_model(_ids(small_model.config, T=20), attention="sparse", indexer_loss=True)
    assert 0 < out.topk_recall.item() < 1


# ---- call validation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, fragment", [
    (dict(attention="flash"), "attention"), (dict(mtp_depths=-1), "mtp_depths"),
    (dict(start_pos=1.5), "start_pos"), (dict(cache="cache"), "cache"),
])
def test_bad_call_arguments(small_model, kwargs, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment):
        small_model(_ids(small_model.config, T=4), **kwargs)


def test_bad_input_ids(small_model, make_model, make_config):
    with pytest.raises(ValueError, match="input_ids"):
        small_model(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="input_ids"):
        small_model(torch.zeros(4, dtype=torch.int64))
    no_mtp = make_model(make_config(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="mtp_depths"):
        no_mtp(torch.zeros(1, 4, dtype=torch.int64), mtp_depths=1)
    assert isinstance(no_mtp.model.layers[1].mlp, MoE) and no_mtp.model.mtp is None


@pytest.mark.parametrize("bad_id", [-1, "vocab"])
def test_token_ids_outside_the_vocabulary_are_named(small_model, bad_id, monkeypatch):
    vocab = small_model.config.vocab_size
    ids = _ids(small_model.config, T=5)
    ids[1, 3] = vocab if bad_id == "vocab" else bad_id
    with pytest.raises(ValueError, match=rf"input_ids: expected token ids in \[0, {vocab}\)"):
        small_model(ids)
    ids[1, 3] = vocab - 1  # the last id is in range
    small_model(ids)
    monkeypatch.setenv("GLM5_CHECK_VALUES", "0")  # production loops skip the sync; torch then raises its own error
    ids[1, 3] = vocab
    with pytest.raises(IndexError):
        small_model(ids)


def test_token_id_range_check_reads_the_device_once(small_model, monkeypatch):
    """The range check costs one device -> host read per forward (a sync on an accelerator), not one per bound."""
    reads = []
    for name in ("__int__", "__index__", "__bool__", "__float__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name, **k: (
                                reads.append(_name), _real(self, *a, **k))[1])
    ids = _ids(small_model.config, T=5)
    small_model._check_call(ids, "dense", 0, None, 0)
    assert len(reads) == 1, reads
    ids[0, 2] = small_model.config.vocab_size
    with pytest.raises(ValueError, match="input_ids: expected token ids"):
        small_model._check_call(ids, "dense", 0, None, 0)


def test_reused_stacked_expert_weights_follow_every_weight_change(make_model, make_config):
    """The inference-server reuse of stacked expert weights must never serve stale weights."""
    cfg = make_config()
    model = make_model(cfg).reuse_stacked_expert_weights(True)
    fresh = make_model(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)  # fills the reuse
        model.load_state_dict(fresh.state_dict())  # new weights: the reused stack must follow
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, atol=0, rtol=0)
        layer = model.moe_layers()[0]
        layer.experts[1].down_proj.weight.mul_(2.0)  # an in-place optimizer-style update of one expert
        fresh.moe_layers()[0].experts[1].down_proj.weight.mul_(2.0)
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, atol=0, rtol=0)
        for seed in (4, 5):  # replaced parameter objects (whatever addresses and version counters they get)
            other = make_model(cfg, seed=seed)
            model.load_state_dict(other.state_dict(), assign=True)
            torch.testing.assert_close(model(ids).logits, other(ids).logits, atol=0, rtol=0)
    model.train()
    model.moe_layers()[0].experts[0].gate_proj.weight.requires_grad_(False)  # one frozen expert, others train
    loss = model(ids).logits.sum()  # with autograd on, the stack is rebuilt and gradients reach the experts
    loss.backward()
    assert all(e.gate_proj.weight.grad is not None for e in model.moe_layers()[0].experts[1:])
    model.reuse_stacked_expert_weights(False)
    assert not any(m.reuse_stacked_weights or m._stacked_cache for m in model.moe_layers())
    with pytest.raises(TypeError, match="enabled"):
        model.reuse_stacked_expert_weights("yes")


def test_stacked_expert_weights_read_a_parametrized_expert_through_its_parametrization(make_model, make_config):
    """The stack reads expert weights from the modules' parameter registries (fast); a weight that is not a plain
    parameter there (torch's parametrize) is read as the module computes it."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    cfg = make_config()
    model = make_model(cfg).reuse_stacked_expert_weights(True)
    layer = model.moe_layers()[0]
    plain = layer._stacked("up_proj").clone()
    parametrize.register_parametrization(layer.experts[2].up_proj, "weight", Doubled())
    with torch.no_grad():
        stacked = layer._stacked("up_proj")
    assert torch.equal(stacked[2], 2 * plain[2]) and torch.equal(stacked[1], plain[1])


@pytest.mark.parametrize("limit", [None, 0.05])
def test_moe_layer_calls_the_bound_fused_kernel_as_the_entry_point_would(limit, monkeypatch, make_model, make_config):
    """Without replay the layer calls the bound ``moe_fused_experts`` kernel directly (no entry-point checks): the
    same output bits as ``moe.fused_experts`` with the layer's clamp; replayed ids still go through the entry
    point (its checks included)."""
    from glm5_core.ops import moe as moe_ops

    model = make_model(make_config(), torch.float32)
    layer = model.moe_layers()[0]
    layer.swiglu_limit = limit  # the routed experts' clamp (GLM-5.3's field; set here on a small GLM-5 model)
    x = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    entry_calls = []
    entry = moe_ops.fused_experts

    def spy(*args, **kwargs):
        entry_calls.append(kwargs.get("swiglu_limit"))
        return entry(*args, **kwargs)

    monkeypatch.setattr(moe_ops, "fused_experts", spy)
    with torch.no_grad():
        got, _, ids = layer.route_and_run(x)
        flat = x.reshape(-1, x.shape[-1])
        weights, _ = layer.gate(flat)
        want = entry(flat, weights.to(flat.dtype), ids.reshape(flat.shape[0], -1), layer._stacked("gate_proj"),
                     layer._stacked("up_proj"), layer._stacked("down_proj"), swiglu_limit=limit,
                     backend=layer.kernels)
        if layer.shared_experts is not None:
            want = want + layer.shared_experts(flat)
        assert entry_calls == [] and torch.equal(got, want.view_as(got))
        replayed, _, _ = layer.route_and_run(x, replay_ids=ids)
    assert entry_calls == [limit] and torch.equal(replayed, got)
