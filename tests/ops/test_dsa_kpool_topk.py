"""The k-pool indexer top-k (``dsa.kpool_topk``, GLM-5.3): against transformers 5.25's Glm5NextTextIndexer (the
module itself, random weights, fp64: the same selected key set per query), and the contract: int32, the layout,
ties to the lower pool, causal, -1 padding, the tail, prefill vs decode and batch / chunk invariance (bitwise)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm5_core.ops import dsa
from glm5_core.ops.kpool_topk import kpool_scores_reference, kpool_topk_reference, pool_keys

glm5_next = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402


def _indexer(kpool, topk, tail, D=16, Q=12, H=3, Dh=8, seed=0):
    cfg = Glm5NextTextConfig(hidden_size=D, q_lora_rank=Q, index_n_heads=H, index_head_dim=Dh, index_topk=topk,
                             index_kpool=kpool, index_kpool_always_select_tail=tail, qk_rope_head_dim=0)
    torch.manual_seed(seed)
    ix = glm5_next.Glm5NextTextIndexer(cfg, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in ix.parameters():
            p.copy_(torch.randn_like(p))
    return ix


def _our_inputs(ix, hidden, q_resid):
    B, S, _ = hidden.shape
    with torch.no_grad():
        q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(hidden))
        w = ix.weights_proj(hidden) * ix.n_heads ** -0.5
        gate = F.linear(hidden, ix.index_kpool_compress_gate)
    return dict(q=q, k=k, w=w, gate=gate, ape=ix.index_kpool_compress_ape.detach())


def _assert_same_selection(got, want, x, kpool, scale):
    """Per query: the same tail tokens, and selected pools whose scores (fp64) are the same multiset -- the same
    pools except where scores tie exactly (ReLU makes many scores 0; transformers' topk breaks ties anyhow)."""
    pooled = pool_keys(x["k"], x["gate"], x["ape"], kpool)
    scores = kpool_scores_reference(x["q"], pooled, x["w"], scale=scale, start_pos=0, kpool=kpool)
    for b in range(got.shape[0]):
        for t in range(got.shape[1]):
            tail_start = t + 1 - (t + 1) % kpool
            rows = [sorted(v for v in r[b, t].tolist() if v >= 0) for r in (got, want)]
            tails = [[v for v in r if v >= tail_start] for r in rows]
            assert tails[0] == tails[1], (b, t)
            picked = [sorted({v // kpool for v in r if v < tail_start}) for r in rows]
            for r, pools in zip(rows, picked):  # whole pools only
                assert sorted(v for v in r if v < tail_start) == [p * kpool + i for p in pools for i in range(kpool)]
            vals = [sorted(scores[b, t, pools].tolist()) for pools in picked]
            assert len(vals[0]) == len(vals[1]) and all(abs(u - v) <= 1e-12 * (1 + abs(v))
                                                        for u, v in zip(*vals)), (b, t, picked, vals)


@pytest.mark.parametrize("kpool,topk,tail,S", [(4, 8, True, 23), (4, 8, False, 23), (3, 6, True, 7), (1, 4, True, 9),
                                               (5, 10, True, 4), (2, 40, True, 17)])
def test_selects_transformers_key_sets(kpool, topk, tail, S):
    ix = _indexer(kpool, topk, tail)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, S, 16, generator=g, dtype=torch.float64)
    q_resid = torch.randn(2, S, 12, generator=g, dtype=torch.float64)
    want = ix(hidden, q_resid, torch.ones(2, S, dtype=torch.bool), None)
    x = _our_inputs(ix, hidden, q_resid)
    got = dsa.kpool_topk(**x, topk=topk, kpool=kpool, select_tail=tail, backend="cpu")
    assert got.dtype == torch.int32 and got.shape == want.shape
    _assert_same_selection(got, want, x, kpool, ix.softmax_scale)


def test_layout_tail_padding_and_causality():
    B, T, H, D, kpool, topk = 1, 11, 2, 4, 3, 6
    g = torch.Generator().manual_seed(2)
    x = dict(q=torch.randn(B, T, H, D, generator=g), k=torch.randn(B, T, D, generator=g),
             w=torch.rand(B, T, H, generator=g), gate=torch.randn(B, T, D, generator=g),
             ape=torch.randn(kpool, D, generator=g))
    out = kpool_topk_reference(**x, topk=topk, kpool=kpool, select_tail=True, scale=0.5)
    assert out.shape == (B, T, topk + kpool - 1)
    for t in range(T):
        row = out[0, t].tolist()
        n_pools = min(topk // kpool, (t + 1) // kpool)
        n = n_pools * kpool + (t + 1) % kpool
        assert all(v >= 0 for v in row[:n]) and all(v == -1 for v in row[n:]), (t, row)
        assert max(row[:n]) <= t  # causal
        tail = row[n_pools * kpool:n]
        assert tail == list(range(t + 1 - (t + 1) % kpool, t + 1))
        for j in range(n_pools):  # whole pools, ascending inside
            block = row[j * kpool:(j + 1) * kpool]
            assert block[0] % kpool == 0 and block == list(range(block[0], block[0] + kpool))
    no_tail = kpool_topk_reference(**x, topk=topk, kpool=kpool, select_tail=False, scale=0.5)
    assert no_tail.shape == (B, T, topk) and (no_tail[0, :kpool - 1] == -1).all()


def test_ties_go_to_the_lower_pool():
    """Pools 0, 1 and 2 identical (same keys, same gates): equal scores; the lower pools win."""
    B, S, H, D, kpool = 1, 12, 2, 4, 3
    k = torch.randn(B, kpool, D).repeat(1, S // kpool, 1)
    gate = torch.randn(B, kpool, D).repeat(1, S // kpool, 1)
    q, w = torch.randn(B, 1, H, D).abs(), torch.rand(B, 1, H)
    k[:, 9:] = -k[:, 9:]  # the last pool differs
    out = dsa.kpool_topk(q, k, w, gate, torch.zeros(kpool, D), topk=6, kpool=kpool, select_tail=False,
                         start_pos=S - 1, backend="cpu")
    scores = pool_keys(k, gate, torch.zeros(kpool, D), kpool)
    assert torch.equal(scores[:, 0], scores[:, 1])
    assert out[0, 0].tolist()[:6] in ([0, 1, 2, 3, 4, 5], [9, 10, 11, 0, 1, 2])
    if out[0, 0, 0] == 0:
        assert out[0, 0].tolist()[:6] == [0, 1, 2, 3, 4, 5]


def test_prefill_equals_decode_and_batch_and_chunk_invariance():
    B, S, H, D, kpool, topk = 3, 37, 4, 16, 4, 12
    g = torch.Generator().manual_seed(5)
    x = dict(q=torch.randn(B, S, H, D, generator=g), k=torch.randn(B, S, D, generator=g),
             w=torch.rand(B, S, H, generator=g), gate=torch.randn(B, S, D, generator=g),
             ape=torch.randn(kpool, D, generator=g))
    kw = dict(topk=topk, kpool=kpool, select_tail=True, backend="cpu")
    full = dsa.kpool_topk(**x, **kw)
    for t in (0, 5, 16, 36):  # decode: one query against the first t + 1 keys
        one = dsa.kpool_topk(x["q"][:, t:t + 1], x["k"][:, :t + 1], x["w"][:, t:t + 1], x["gate"][:, :t + 1],
                             x["ape"], start_pos=t, **kw)
        assert torch.equal(one[:, 0], full[:, t]), t
    chunk = dsa.kpool_topk(x["q"][:, 20:], x["k"], x["w"][:, 20:], x["gate"], x["ape"], start_pos=20, **kw)
    assert torch.equal(chunk, full[:, 20:])
    single = dsa.kpool_topk(*(v[1:2] for v in (x["q"], x["k"], x["w"], x["gate"])), x["ape"], **kw)
    assert torch.equal(single[0], full[1])


@pytest.mark.parametrize("kw,error,match", [
    (dict(topk=7), ValueError, "topk"), (dict(kpool=0), ValueError, "kpool"), (dict(select_tail=1), TypeError,
                                                                                  "select_tail"),
    (dict(scale=-1.0), ValueError, "scale")])
def test_bad_arguments_are_named(kw, error, match):
    B, S, H, D = 1, 8, 2, 4
    x = dict(q=torch.randn(B, S, H, D), k=torch.randn(B, S, D), w=torch.rand(B, S, H), gate=torch.randn(B, S, D))
    args = dict(topk=4, kpool=2, select_tail=True)
    args.update(kw)
    ape = torch.zeros(max(args["kpool"], 1), D)
    with pytest.raises(error, match=match):
        dsa.kpool_topk(**x, ape=ape, **args)


def _pool_keys_token_by_token(k, gate, ape, kpool):
    """The pooled keys as the contract states them, one token slice at a time in token order (the form
    ``pool_keys`` had before it worked on whole [B, P, kpool, D] tensors)."""
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    B, S, D = k.shape
    P = S // kpool
    keys = k[:, :P * kpool].to(ct).reshape(B, P, kpool, D).unbind(2)
    logits = (gate[:, :P * kpool].to(ct).reshape(B, P, kpool, D) + ape.to(ct)).unbind(2)
    top = logits[0]
    for i in range(1, kpool):
        top = torch.maximum(top, logits[i])
    exps = [torch.exp(logit - top) for logit in logits]
    total = exps[0]
    for i in range(1, kpool):
        total = total + exps[i]
    pooled = (exps[0] / total) * keys[0]
    for i in range(1, kpool):
        pooled = pooled + (exps[i] / total) * keys[i]
    return pooled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_pool_keys_is_bitwise_the_token_by_token_form(dtype):
    """Whole-tensor max / exp / division / product, the sums still in token order: the same bits as the
    token-by-token form (pool sizes 1 / 4 / 16, odd and vector-wide key dims, an incomplete last pool, signed
    zeros among the logits)."""
    for kpool in (1, 4, 16):
        for D, S in ((5, kpool * 3 + 1), (32, kpool * 7)):
            g = torch.Generator().manual_seed(S * D + kpool)
            k = torch.randn(2, S, D, generator=g).to(dtype)
            gate = (torch.randn(2, S, D, generator=g) * 3).to(dtype)
            gate[0, 0, :2], gate[1, 0, :2] = 0.0, -0.0
            ape = torch.randn(kpool, D, generator=g).to(dtype)
            got, want = pool_keys(k, gate, ape, kpool), _pool_keys_token_by_token(k, gate, ape, kpool)
            assert got.dtype == want.dtype and torch.equal(got, want), (kpool, D, S)
