"""The sparse training path (no cache) runs the expanded-form kernel and computes what the absorbed form does:
logits, the indexer KL / recall and every parameter's gradient agree with a prefill against a cache (which keeps
the absorbed ``dsa_sparse_prefill``); the cost rule picks the expanded form for these head sizes."""
import torch

from glm5_core import registry
from glm5_core.ops import dsa


def _sparse_step(model, ids, cache):
    model.zero_grad()
    out = model(ids, attention="sparse", indexer_loss=True, cache=cache, start_pos=0)
    (torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) +
     out.indexer_kl).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def test_expanded_training_path_matches_the_absorbed_prefill(make_model, make_config, monkeypatch):
    model = make_model(make_config()).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(4))
    calls = []
    real = registry.call

    def recording(op, *args, **kwargs):
        calls.append(op)
        return real(op, *args, **kwargs)

    monkeypatch.setattr(registry, "call", recording)
    expanded, grads = _sparse_step(model, ids, cache=None)
    assert "dsa_sparse_prefill_expanded" in calls and "dsa_sparse_prefill" not in calls
    calls.clear()
    absorbed, want = _sparse_step(model, ids, cache=model.new_cache(2, 19))
    assert "dsa_sparse_prefill" in calls and "dsa_sparse_prefill_expanded" not in calls
    torch.testing.assert_close(expanded.logits, absorbed.logits, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(expanded.indexer_kl, absorbed.indexer_kl, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(expanded.topk_recall, absorbed.topk_recall, atol=1e-10, rtol=1e-10)
    assert set(grads) == set(want) and grads
    for name in want:
        torch.testing.assert_close(grads[name], want[name], atol=1e-10, rtol=1e-8, msg=name)


def test_cost_rule_prefers_the_expanded_form_only_when_it_is_cheaper(make_model, make_config):
    attn = make_model(make_config()).model.layers[0].self_attn  # Dn 8, Dr 6, Dv 10, C 20: Dn + Dv < 2 C
    assert attn._expanded_is_cheaper(queries=64, keys=64, topk=8)
    assert not attn._expanded_is_cheaper(queries=1, keys=4096, topk=8)  # one query: expanding 4096 keys costs more
    many_heads = make_model(make_config(num_attention_heads=16)).model.layers[0].self_attn  # reads 294 vs 26 a key
    assert not many_heads._expanded_is_cheaper(queries=64, keys=64, topk=8)
    sizes = dict(queries=4096, keys=4096, topk=2048)
    assert dsa.prefers_expanded(heads=8, nope_dim=32, rope_dim=16, v_dim=32, kv_rank=128, **sizes)  # training bench
    assert not dsa.prefers_expanded(heads=8, nope_dim=96, rope_dim=32, v_dim=128, kv_rank=256, **sizes)  # kernelize's


def test_a_backend_without_an_expanded_kernel_keeps_its_native_absorbed_one(make_model, make_config):
    from glm5_core.model.attention import MLA

    cfg = make_config()
    assert MLA(cfg, 0, "full", "cpu").expanded_sparse_native  # both native: the cost rule decides
    cuda = registry.bind("cuda") if registry.get_backend("cuda").available()[0] else None
    if cuda is not None and not cuda.resolution("dsa_sparse_prefill").is_reference:
        layer = MLA(cfg, 0, "full", cuda)
        assert not layer.expanded_sparse_native and not layer._expanded_is_cheaper(64, 64, 8)
