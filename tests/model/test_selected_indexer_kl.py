"""The sparse stage's indexer KL from the selected keys only: with the "causal" target, the same values and
gradients as the dense formulas gathered at the selected keys, computed in query blocks; with no [B, T, S] tensor
(either target)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5_core import testing
from glm5_core.model import indexer_loss
from glm5_core.ops import dsa, selected_attention_target, selected_index_scores

BLOCKS = (1, 3, 1000)  # one query a block, blocks that do not divide T, one block for everything


def _double(x):
    """fp64 copies of the float inputs (the indices keep their int dtype)."""
    return {n: t.double() if t.is_floating_point() else t for n, t in x.items()}


@pytest.mark.parametrize("block", BLOCKS)
def test_selected_scores_and_gradients_equal_the_dense_scores_gathered(monkeypatch, block):
    monkeypatch.setattr(selected_index_scores, "QUERY_BLOCK", block)
    shape = testing.IndexerShape(B=2, T=7, S=7, H=3, D=8, K=4)
    x = {n: t.double().requires_grad_(True) for n, t in testing.make_indexer_inputs(shape, seed=1).items()}
    idx = dsa.indexer_topk_reference(x["q"].detach(), x["k"].detach(), x["w"].detach(), topk=shape.K)
    idx[0, 5, 1] = -1  # a -1 slot in the middle of a row
    got = selected_index_scores.selected_index_scores_reference(x["q"], x["k"], x["w"], idx)
    dense = dsa.indexer_scores_reference(x["q"], x["k"], x["w"])  # [B, T, S]
    keep = idx >= 0
    want = dense.gather(-1, idx.clamp(min=0).long()).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(got, want)
    weights = torch.randn(idx.shape, dtype=torch.float64).masked_fill(~keep, 0.0)
    grads_got = torch.autograd.grad((got.masked_fill(~keep, 0.0) * weights).sum(), [x["q"], x["k"], x["w"]])
    grads_want = torch.autograd.grad((want.masked_fill(~keep, 0.0) * weights).sum(), [x["q"], x["k"], x["w"]])
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w)


def test_selected_scores_pass_gradcheck():
    shape = testing.IndexerShape(B=1, T=5, S=5, H=2, D=4, K=3)
    x = {n: t.double() for n, t in testing.make_indexer_inputs(shape, seed=2).items()}
    idx = dsa.indexer_topk_reference(x["q"], x["k"], x["w"], topk=shape.K)
    keep = idx >= 0
    leaves = [x[n].clone().requires_grad_(True) for n in ("q", "k", "w")]
    assert torch.autograd.gradcheck(
        lambda q, k, w: selected_index_scores.selected_index_scores_reference(q, k, w, idx).masked_fill(~keep, 0.0),
        leaves)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("start", ("0", "4", "ragged"))
def test_selected_target_kl_and_recall_equal_the_dense_ones(monkeypatch, block, start):
    monkeypatch.setattr(selected_attention_target, "QUERY_BLOCK", block)
    start_pos = torch.tensor([1, 4]) if start == "ragged" else int(start)
    shape = testing.MLAShape(B=2, T=6, S=6 + (4 if start == "ragged" else start_pos), H=3, Dn=5, Dr=4, Dv=6, C=7)
    x = _double(testing.make_sparse_inputs(shape, 3, seed=3, start_pos=start_pos))
    idx = x["topk_idx"]
    args = (x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], x["w_uk"])
    target = indexer_loss.attention_target(*args, scale=0.4, start_pos=start_pos)  # [B, T, S]
    selected = indexer_loss.selected_attention_target(*args, idx, scale=0.4, start_pos=start_pos,
                                                      normaliser="causal")  # [B, T, K]
    blocked = selected_attention_target.selected_attention_target_reference(*args, idx, scale=0.4,
                                                                            start_pos=start_pos,
                                                                            normaliser="causal")  # [B, T, K]
    keep = idx >= 0
    torch.testing.assert_close(selected, target.gather(-1, idx.clamp(min=0).long()).masked_fill(~keep, 0.0))
    torch.testing.assert_close(blocked, target.gather(-1, idx.clamp(min=0).long()).masked_fill(~keep, 0.0))
    scores = torch.randn(shape.B, shape.T, shape.S, dtype=torch.float64)
    selected_scores = scores.gather(-1, idx.clamp(min=0).long()).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(indexer_loss.selected_kl(selected, selected_scores, idx),
                               indexer_loss.sparse_kl(target, scores, idx))
    torch.testing.assert_close(indexer_loss.selected_recall(selected), indexer_loss.topk_recall(target, idx))


class _Shapes(TorchDispatchMode):
    """The shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("target", ("selected", "causal"))
def test_the_sparse_indexer_kl_makes_no_query_by_key_tensor(monkeypatch, make_model, make_config, target):
    """T = S = 24 (no other size of the model is 24): no tensor made for the sparse stage's indexer KL, forward
    or backward, holds a [T, S] plane (the top-k selection is the kernels' business: tests/backends/cpu)."""
    from glm5_core.model import attention

    monkeypatch.setattr(selected_attention_target, "QUERY_BLOCK", 4)
    seen = _Shapes()
    signals = attention.MLA._indexer_signals

    def watched(self, *args, **kwargs):
        with seen:
            return signals(self, *args, **kwargs)

    monkeypatch.setattr(attention.MLA, "_indexer_signals", watched)
    model = make_model(make_config(max_position_embeddings=32), dtype=torch.float32).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    out = model(ids, attention="sparse", indexer_loss=True, indexer_kl_target=target)
    with seen:
        grads = torch.autograd.grad(out.indexer_kl, list(model.indexer_parameters()), allow_unused=True)
    assert out.indexer_kl.item() > 0 and any(g is not None and g.any() for g in grads)
    assert len(seen.shapes) > 50  # the mode saw the KL's ops
    planes = [s for s in seen.shapes if any(s[i:i + 2] == (24, 24) for i in range(len(s) - 1))]
    assert planes == []


def test_selected_target_from_the_expanded_keys_equals_the_one_from_the_latent():
    shape = testing.MLAShape(B=2, T=6, S=6, H=3, Dn=5, Dr=4, Dv=6, C=7)
    x = _double(testing.make_sparse_inputs(shape, 3, seed=5, start_pos=0))
    args = (x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], x["w_uk"], x["topk_idx"])
    k_nope = torch.einsum("bsc,hdc->bshd", x["c_kv"], x["w_uk"])  # [B, S, H, Dn], as kv_b_proj gives it
    from_latent = indexer_loss.selected_attention_target(*args, scale=0.4, start_pos=0)
    from_keys = indexer_loss.selected_attention_target(*args, scale=0.4, start_pos=0, k_nope=k_nope)
    torch.testing.assert_close(from_keys, from_latent)
    wrong = indexer_loss.selected_attention_target(*args, scale=0.4, start_pos=0, k_nope=k_nope.flip(1))
    assert not torch.allclose(wrong, from_latent)  # the keys given are the ones used


@pytest.mark.parametrize("block", BLOCKS)
def test_selected_target_is_zero_at_keys_past_the_query(monkeypatch, block):
    """A selected key past the query (past every query of its block, too) has probability 0, as in the dense
    target (the blocked reference used to fail there: it gathered past the keys it had computed)."""
    monkeypatch.setattr(selected_attention_target, "QUERY_BLOCK", block)
    shape = testing.MLAShape(B=2, T=6, S=9, H=3, Dn=5, Dr=4, Dv=6, C=7)
    x = _double(testing.make_sparse_inputs(shape, 3, seed=6, start_pos=0))
    idx = x["topk_idx"].clone()
    idx[:, :, -1] = shape.S - 1  # the last key slot: past every query (positions 0..5)
    args = (x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], x["w_uk"])
    target = indexer_loss.attention_target(*args, scale=0.4, start_pos=0)  # [B, T, S]
    want = target.gather(-1, idx.clamp(min=0).long()).masked_fill(idx < 0, 0.0)
    got = selected_attention_target.selected_attention_target_reference(*args, idx, scale=0.4, start_pos=0,
                                                                        normaliser="causal")
    torch.testing.assert_close(got, want)
    assert torch.equal(got[..., -1], torch.zeros_like(got[..., -1]))


def test_the_model_trains_the_kl_on_the_target_asked_for_and_measures_recall_only_when_asked(make_model,
                                                                                            make_config):
    """indexer_kl_target picks the sparse KL's target; the recall is the dense target's mass whatever the KL's
    target, and absent with measure_recall=False (which leaves the KL bitwise as it was)."""
    model = make_model(make_config(max_position_embeddings=32), dtype=torch.float64).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        selected = model(ids, attention="sparse", indexer_loss=True)  # the default target
        causal = model(ids, attention="sparse", indexer_loss=True, indexer_kl_target="causal")
        quiet = model(ids, attention="sparse", indexer_loss=True, measure_recall=False)
        dense = model(ids, attention="dense", indexer_loss=True)
    assert torch.equal(selected.logits, causal.logits) and torch.equal(selected.logits, quiet.logits)
    assert not torch.allclose(selected.indexer_kl, causal.indexer_kl)
    torch.testing.assert_close(selected.topk_recall, causal.topk_recall, rtol=1e-12, atol=0)
    assert 0 < selected.topk_recall.item() < 1
    assert quiet.topk_recall is None and torch.equal(quiet.indexer_kl, selected.indexer_kl)
    assert dense.topk_recall is not None  # the dense attention's recall comes with its target
    with pytest.raises(ValueError, match="indexer_kl_target: expected one of 'selected', 'causal', got 'dense'"):
        model(ids, attention="sparse", indexer_loss=True, indexer_kl_target="dense")


def test_the_selected_kl_is_the_kl_to_the_per_head_selected_softmax(monkeypatch, make_model, make_config):
    """The model's sparse KL with the "selected" target equals selected_kl of the target computed from the layer's
    own queries and keys by the independent dense formula: masked per-head softmax over the selected keys."""
    from glm5_core.model import attention

    model = make_model(make_config(max_position_embeddings=32), dtype=torch.float64).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    seen = []
    signals = attention.MLA._indexer_signals

    def watched(self, q_nope, q_pe, c_kv, k_pe, w_uk, attn_start, topk_idx, index_inputs, state, k_nope=None):
        seen.append((q_nope, q_pe, c_kv, k_pe, w_uk, topk_idx, index_inputs, self.scale))
        return signals(self, q_nope, q_pe, c_kv, k_pe, w_uk, attn_start, topk_idx, index_inputs, state,
                       k_nope=k_nope)

    monkeypatch.setattr(attention.MLA, "_indexer_signals", watched)
    with torch.no_grad():
        out = model(ids, attention="sparse", indexer_loss=True, measure_recall=False)
    kls = []
    for q_nope, q_pe, c_kv, k_pe, w_uk, idx, (q_i, k_i, w_i, _), scale in seen:
        S = c_kv.shape[1]
        scores = torch.einsum("bthd,bshd->bhts", q_nope, torch.einsum("bsc,hdc->bshd", c_kv, w_uk))
        scores = (scores + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)) * scale  # [B, H, T, S]
        chosen = torch.zeros(*idx.shape[:2], S + 1, dtype=torch.bool)
        chosen.scatter_(-1, torch.where(idx < 0, S, idx.long()), True)
        keep = chosen[..., :S] & torch.ones(idx.shape[1], S, dtype=torch.bool).tril()  # [B, T, S]
        probs = torch.softmax(scores.masked_fill(~keep.unsqueeze(1), float("-inf")), -1).nan_to_num(0.0)
        target = (probs.sum(1) / probs.shape[1]).gather(-1, idx.clamp(min=0).long()).masked_fill(idx < 0, 0.0)
        kls.append(indexer_loss.selected_kl(target, dsa.selected_index_scores(q_i, k_i, w_i, idx), idx))
    assert len(kls) >= 2
    torch.testing.assert_close(out.indexer_kl, torch.stack(kls).mean(), rtol=1e-10, atol=1e-12)
