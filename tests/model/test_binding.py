"""The model's layers bind their kernels once, when it is built (registry.bind). The bound forward computes
bitwise what the per-call dispatch by backend name computes (the code path every layer used before binding),
in training and decode, and a bound forward resolves nothing again."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from glm5_core import registry
from glm5_core.model import GLM5ForCausalLM


def _unbound(model: GLM5ForCausalLM, backend: str) -> GLM5ForCausalLM:
    """``model`` dispatching every op call by backend name, resolved per call (as before binding)."""
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), registry.Binding):
            module.kernels = backend
    return model


def _training_step(model, ids, attention):
    """Everything a training forward returns, and the parameter gradients of a loss over all of it."""
    out = model(ids, attention=attention, indexer_loss=True, mtp_depths=1)
    loss = out.logits.square().mean() + out.mtp_logits[0].square().mean() + out.indexer_kl
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [out.logits, out.mtp_logits[0], out.indexer_kl, out.expert_counts, *out.topk_idx, *grads]


def _decode(model, ids, attention):
    """Prefill 5 tokens into a cache, then decode the rest one at a time: every step's logits and top-k."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    outs = [model(ids[:, :5], attention=attention, cache=cache, start_pos=0)]
    outs += [model(ids[:, t:t + 1], attention=attention, cache=cache, start_pos=t) for t in range(5, ids.shape[1])]
    return [t for o in outs for t in (o.logits, o.expert_counts, *o.topk_idx)]


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs"


@pytest.mark.parametrize("attention", ("dense", "sparse"))
def test_bound_training_forward_and_backward_are_bitwise_the_per_call_dispatch(attention, make_model, make_config):
    cfg = make_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    bound = make_model(cfg, torch.float32).train()
    per_call = _unbound(make_model(cfg, torch.float32).train(), "cpu")
    assert isinstance(bound.kernels, registry.Binding) and bound.kernels.backend == "cpu"
    _assert_bitwise(_training_step(bound, ids, attention), _training_step(per_call, ids, attention))


@pytest.mark.parametrize("attention", ("dense", "sparse"))
def test_bound_decode_is_bitwise_the_per_call_dispatch(attention, make_model, make_config):
    cfg = make_config()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    bound, per_call = make_model(cfg, torch.float32), _unbound(make_model(cfg, torch.float32), "cpu")
    with torch.no_grad():
        _assert_bitwise(_decode(bound, ids, attention), _decode(per_call, ids, attention))


def test_expert_counts_are_the_bincount_of_the_routed_ids(make_model, make_config):
    model = make_model(make_config())
    moe = model.moe_layers()[0]
    ids = torch.randint(0, moe.n_experts, (17, 2), generator=torch.Generator().manual_seed(5)).to(torch.int32)
    counts = moe._tokens_per_expert(ids)
    assert counts.dtype == torch.int64 and torch.equal(counts, torch.bincount(ids.reshape(-1).long(),
                                                                              minlength=moe.n_experts))


def test_a_bound_forward_resolves_nothing(monkeypatch, make_model, make_config):
    """After construction, neither the backend name nor any op's resolution is looked up again."""
    cfg = make_config()
    model = make_model(cfg, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(6))

    def no_lookup(*args, **kwargs):
        raise AssertionError("a bound call looked its resolution up")

    monkeypatch.setattr(registry, "resolve_backend_name", no_lookup)
    monkeypatch.setattr(registry, "_lookup", no_lookup)
    with torch.no_grad():
        model(ids, attention="sparse")
    model(ids, indexer_loss=True, mtp_depths=1).logits.sum().backward()


def test_layers_bind_the_backend_resolved_when_the_model_is_built(monkeypatch, make_config):
    """Resolution order at construction: argument > use_backend context / GLM5_BACKEND > auto-detection; a
    context or variable that changes afterwards does not move a built model."""
    cfg = make_config(num_hidden_layers=2, indexer_types=["full", "shared"], num_nextn_predict_layers=0)
    monkeypatch.setenv("GLM5_BACKEND", "cpu")
    model = GLM5ForCausalLM(cfg)
    layers = [m for m in model.modules() if isinstance(getattr(m, "kernels", None), registry.Binding)]
    assert len(layers) >= 4 and all(m.kernels is model.kernels for m in layers)  # one binding, shared
    assert model.kernels.backend == "cpu" and model.backend is None
    monkeypatch.setenv("GLM5_BACKEND", "no-such-backend")  # a per-call resolution would now raise
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    unavailable = next((n for n, b in registry.backends().items() if not b.available()[0]), None)
    if unavailable is not None:
        with pytest.raises(registry.BackendUnavailableError, match=unavailable):
            GLM5ForCausalLM(cfg, backend=unavailable)  # at construction, not at the first forward


def test_bind_backend_rebinds_every_layer(make_model, make_config):
    model = make_model(make_config())
    before = model.kernels
    assert model.bind_backend("cpu") is model
    bound = {id(m.kernels) for m in model.modules() if isinstance(getattr(m, "kernels", None), registry.Binding)}
    assert bound == {id(model.kernels)} and model.kernels is not before and model.backend == "cpu"
    with pytest.raises(TypeError, match="backend: expected a backend name"):
        model.bind_backend(3)


def test_copies_share_the_binding_and_pickling_rebinds_by_name(make_model, make_config):
    model = make_model(make_config())
    assert copy.deepcopy(model).kernels is model.kernels
    restored = pickle.loads(pickle.dumps(model.kernels))
    assert isinstance(restored, registry.Binding) and restored.backend == "cpu"
    assert restored.resolutions.keys() == model.kernels.resolutions.keys()


def _hybrid_config(make_config):
    """A GLM-5.3 (glm5_next) config: KDA and indexed layers, mHC streams, the k-pool indexer."""
    return make_config(model_type="glm5_next", num_hidden_layers=2, qk_rope_head_dim=0, hc_mult=2,
                       layer_types=["linear_attention", "indexed_attention"],
                       first_k_dense_replace=1, indexer_types=["full", "full"], index_kpool=4, index_topk=8,
                       linear_num_heads=2, linear_head_dim=8, num_nextn_predict_layers=0)


def test_a_bound_glm53_forward_resolves_nothing(monkeypatch, make_model, make_config):
    """GLM-5.3's KDA layers hold the model's binding too (they resolved every KDA op call by auto-detection
    before, ~20 us a call), in decode and in training."""
    model = make_model(_hybrid_config(make_config), torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(6))

    def no_lookup(*args, **kwargs):
        raise AssertionError("a bound call looked its resolution up")

    cache = model.new_cache(2, 12)
    monkeypatch.setattr(registry, "resolve_backend_name", no_lookup)
    monkeypatch.setattr(registry, "_lookup", no_lookup)
    with torch.no_grad():
        model(ids, attention="sparse", cache=cache, start_pos=0)
        model(ids[:, :1], attention="sparse", cache=cache, start_pos=10)
    model(ids, attention="sparse").logits.sum().backward()
    assert model.model.layers[0].self_attn.kernels is model.kernels


def test_glm53_bind_backend_rebinds_the_kda_layers(make_model, make_config):
    model = make_model(_hybrid_config(make_config))
    model.bind_backend("cpu")
    assert model.model.layers[0].self_attn.kernels is model.kernels
