"""Prefill and token-by-token decode agree: logits (fp64 / fp32 tolerance) and the selected keys (bitwise)."""
from __future__ import annotations

import pytest
import torch

TOL = {torch.float64: 1e-10, torch.float32: 2e-4}


def _decode_steps(model, ids, attention, prefill_len=1):
    """Prefill ids[:, :prefill_len] into a cache, then one token per call; returns logits and per-step top-k."""
    B, T = ids.shape
    cache = model.new_cache(B, T + 3)
    out = model(ids[:, :prefill_len], attention=attention, cache=cache, start_pos=0)
    logits, topk = [out.logits], [out.topk_idx]
    for t in range(prefill_len, T):
        out = model(ids[:, t:t + 1], attention=attention, cache=cache, start_pos=t)
        logits.append(out.logits)
        topk.append(out.topk_idx)
    return torch.cat(logits, dim=1), topk


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("prefill_len", [1, 7])
def test_dense_decode_matches_prefill(dtype, prefill_len, make_model, make_config):
    model = make_model(make_config(), dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, attention="dense").logits
        stepped, _ = _decode_steps(model, ids, "dense", prefill_len)
    torch.testing.assert_close(stepped, full, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sparse_decode_matches_prefill_logits_and_keys(dtype, make_model, make_config):
    model = make_model(make_config(), dtype)
    T = 21  # > index_topk = 8, so the selection drops keys
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, attention="sparse")
        dense = model(ids, attention="dense").logits
        stepped, topk = _decode_steps(model, ids, "sparse")
    torch.testing.assert_close(stepped, full.logits, atol=TOL[dtype], rtol=TOL[dtype])
    assert not torch.allclose(full.logits, dense, atol=1e-3), "sparse attention should differ from dense at T > top-k"
    assert len(full.topk_idx) == 2  # the two "full" layers; the "shared" layer reuses the first one's
    for t in range(T):
        for layer, prefill_idx in enumerate(full.topk_idx):
            assert torch.equal(topk[t][layer][:, 0], prefill_idx[:, t]), f"step {t}, full layer {layer}"


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_chunked_prefill_matches_one_shot(attention, make_model, make_config):
    """Two chunks (10 tokens, then 11 against the cache: the multi-query decode path) equal one prefill."""
    model = make_model(make_config())
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids, attention=attention)
        cache = model.new_cache(2, 21)
        first = model(ids[:, :10], attention=attention, cache=cache, start_pos=0)
        second = model(ids[:, 10:], attention=attention, cache=cache, start_pos=10)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full.logits, atol=1e-10, rtol=1e-10)
    for layer, idx in enumerate(full.topk_idx):
        assert torch.equal(torch.cat([first.topk_idx[layer], second.topk_idx[layer]], 1), idx)


def test_sparse_equals_dense_when_topk_covers_every_key(make_model, make_config):
    model = make_model(make_config(index_topk=32))
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sparse = model(ids, attention="sparse")
        dense = model(ids, attention="dense")
    torch.testing.assert_close(sparse.logits, dense.logits, atol=1e-10, rtol=1e-10)
    for idx in sparse.topk_idx:  # row t selects keys 0..t, then -1 padding
        assert torch.equal((idx >= 0).sum(-1), torch.arange(1, 18).expand(2, 17))


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_ragged_batch_decode_matches_single_rows(attention, make_model, make_config):
    """Right-padded prompts of lengths 5 and 11 prefilled together, then decoded with start_pos [B]."""
    model = make_model(make_config())
    gen = torch.Generator().manual_seed(4)
    lengths, new_tokens = [5, 11], 6
    rows = [torch.randint(0, model.config.vocab_size, (1, n + new_tokens), generator=gen) for n in lengths]
    with torch.no_grad():
        expected = [model(r, attention=attention).logits for r in rows]
        prompt = torch.zeros(2, max(lengths), dtype=torch.int64)
        for b, n in enumerate(lengths):
            prompt[b, :n] = rows[b][0, :n]
        cache = model.new_cache(2, max(lengths) + new_tokens)
        model(prompt, attention=attention, cache=cache, start_pos=0)
        for step in range(new_tokens):
            pos = torch.tensor(lengths) + step
            token = torch.stack([rows[b][0, pos[b]] for b in range(2)]).view(2, 1)
            out = model(token, attention=attention, cache=cache, start_pos=pos)
            for b in range(2):
                torch.testing.assert_close(out.logits[b, 0], expected[b][0, pos[b]], atol=1e-10, rtol=1e-10)


def test_cache_holds_only_the_latent_and_index_keys(small_model):
    cfg = small_model.config
    cache = small_model.new_cache(2, 9)
    assert [tuple(t.shape) for t in cache.c_kv] == [(2, 9, cfg.kv_lora_rank)] * 3
    assert [tuple(t.shape) for t in cache.k_pe] == [(2, 9, cfg.qk_rope_head_dim)] * 3
    assert [None if t is None else tuple(t.shape) for t in cache.index_k] == [(2, 9, cfg.index_head_dim), None,
                                                                              (2, 9, cfg.index_head_dim)]


def test_cache_window_errors(small_model):
    cache = small_model.new_cache(2, 8)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="start_pos"):
        small_model(ids, cache=cache, start_pos=6)
    with pytest.raises(ValueError, match="batch"):
        small_model(ids[:1], cache=cache, start_pos=0)
    with pytest.raises(ValueError, match="start_pos"):
        small_model(ids, start_pos=2)  # no cache
    with pytest.raises(ValueError, match="mtp_depths"):
        small_model(ids, cache=cache, mtp_depths=1)
