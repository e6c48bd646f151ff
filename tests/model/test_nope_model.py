"""The model with NoPE attention (qk_rope_head_dim = 0, GLM-5.3's MLA): the config accepts it, the latent cache
holds no rope keys, sparse decode matches the prefill (logits and selected keys), and training gets gradients."""
from __future__ import annotations

import pytest
import torch

from glm5_core.model import GLM5Config


def test_config_accepts_zero_rope_dim_and_still_refuses_odd_or_negative(make_config):
    assert make_config(qk_rope_head_dim=0).qk_head_dim == 8
    for bad in (-2, 3):
        with pytest.raises(ValueError, match="qk_rope_head_dim"):
            GLM5Config.tiny(qk_rope_head_dim=bad).validate()


def test_nope_sparse_decode_matches_prefill_and_trains(make_model, make_config):
    model = make_model(make_config(qk_rope_head_dim=0), torch.float64)
    assert model.model.layers[0].self_attn.kv_a_proj_with_mqa.out_features == model.config.kv_lora_rank
    T = 13  # > index_topk = 8
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids, attention="sparse")
        cache = model.new_cache(2, T)
        steps = [model(ids[:, :1], attention="sparse", cache=cache, start_pos=0)]
        steps += [model(ids[:, t:t + 1], attention="sparse", cache=cache, start_pos=t) for t in range(1, T)]
    assert cache.k_pe[0].shape[-1] == 0
    torch.testing.assert_close(torch.cat([s.logits for s in steps], 1), full.logits, rtol=1e-10, atol=1e-10)
    for t, step in enumerate(steps):
        for layer, idx in enumerate(full.topk_idx):
            assert torch.equal(step.topk_idx[layer][:, 0], idx[:, t])
    model.train()
    loss = model(ids, attention="sparse").logits.square().mean()
    loss.backward()
    q_b = model.model.layers[0].self_attn.q_b_proj.weight
    assert q_b.grad is not None and q_b.grad.abs().sum() > 0
