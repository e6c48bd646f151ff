"""``glm5_core.integrations.transformers.kernelize``: a transformers GlmMoeDsaForCausalLM whose DSA indexer
top-k, sparse attention, router and experts run glm5-core ops computes transformers' logits (fp32, past
index_topk, full and shared indexer layers) and greedy ``generate`` tokens, keeps its parameters, and
refuses what it does not recognise."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", minversion="5.17")

from glm5_core import registry  # noqa: E402
from glm5_core.integrations.transformers import kernelize  # noqa: E402
from tests.integrations.hf_models import (  # noqa: E402
    SEQ_LEN,
    hf_config,
    hf_model,
    median_position_err,
    rel_err,
    token_ids,
)

FP32_RTOL = 1e-5
INDEXER_LAYOUTS = {"full": ["full"] * 4, "shared": ["full", "shared", "full", "shared"]}


@pytest.fixture
def op_calls(monkeypatch):
    """(op, backend) of every registry call made while the test runs."""
    calls = []
    real = registry.call

    def recording(op, *args, backend=None, **kwargs):
        calls.append((op, backend))
        return real(op, *args, backend=backend, **kwargs)

    monkeypatch.setattr(registry, "call", recording)
    return calls


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def _greedy(model, prompt, **kwargs):
    return model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("layout", sorted(INDEXER_LAYOUTS))
def test_kernelized_model_computes_transformers_logits_with_the_same_parameters(layout, op_calls):
    hf = hf_model(hf_config(indexer_types=INDEXER_LAYOUTS[layout]))
    ids = token_ids(hf.config.vocab_size)
    want = _logits(hf, ids)
    before = hf.state_dict(keep_vars=True)
    assert kernelize(hf, backend="cpu") is hf
    after = hf.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)  # same tensor objects
    assert not op_calls
    assert rel_err(_logits(hf, ids), want) < FP32_RTOL
    # slots below index_topk see every key they may select: dense causal attention (torch's sdpa, no registry
    # op); the others: indexer top-k + sparse MLA, in the expanded form at this small geometry (prefers_expanded)
    assert {op for op, _ in op_calls} == {"dsa_indexer_topk", "dsa_sparse_prefill_expanded", "moe_route",
                                          "moe_fused_experts"}
    assert {backend for _, backend in op_calls} == {"cpu"}


@pytest.mark.parametrize("layout", sorted(INDEXER_LAYOUTS))
def test_generate_gives_the_same_greedy_tokens(layout, op_calls):
    hf = hf_model(hf_config(indexer_types=INDEXER_LAYOUTS[layout]))
    prompt = token_ids(hf.config.vocab_size, seq_len=SEQ_LEN - 12)  # past index_topk while decoding
    want = _greedy(hf, prompt)
    kernelize(hf, backend="cpu")
    assert torch.equal(_greedy(hf, prompt), want)
    decode_calls = [op for op, _ in op_calls if op == "dsa_sparse_decode"]
    assert len(decode_calls) == 11 * hf.config.num_hidden_layers  # every step after the prefill, every layer


def test_generate_with_a_left_padded_batch():
    """A padded batch's mask is not only causal: padded keys are never selected, so the tokens agree."""
    hf = hf_model(hf_config())
    prompt = token_ids(hf.config.vocab_size, seq_len=10)
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    want = _greedy(hf, prompt, attention_mask=mask)
    assert torch.equal(_greedy(kernelize(hf), prompt, attention_mask=mask), want)


def _padded(prompt: torch.Tensor) -> torch.Tensor:
    """An attention mask with pads inside the rows (as generate infers from a pad_token_id the prompt holds)
    and at the left of row 1."""
    mask = torch.ones_like(prompt)
    mask[0, 3] = mask[0, prompt.shape[1] // 2] = 0
    mask[1, :2] = 0
    return mask


@pytest.mark.parametrize("layout", sorted(INDEXER_LAYOUTS))
def test_padded_prefill_computes_transformers_logits(layout):
    """Under a padded mask the queries below index_topk attend to every key their mask shows (no indexer
    scores), the later ones to the masked top-k: transformers' logits at every position that is not a pad."""
    hf = hf_model(hf_config(indexer_types=INDEXER_LAYOUTS[layout]))
    ids = token_ids(hf.config.vocab_size)
    mask = _padded(ids)
    want = _logits(hf, ids, attention_mask=mask)
    got = _logits(kernelize(hf, backend="cpu"), ids, attention_mask=mask)
    kept = mask.bool()
    assert rel_err(got[kept], want[kept]) < FP32_RTOL


def test_padded_generate_below_index_topk_computes_transformers_logits():
    """Decode steps at slots below index_topk under a padded mask select every key the mask shows."""
    hf = hf_model(hf_config())
    prompt = token_ids(hf.config.vocab_size, seq_len=hf.config.index_topk - 4)  # steps cross index_topk
    mask = _padded(prompt)

    def step_logits(model):
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        return torch.stack(out.logits, dim=1)  # [B, steps, V]

    want = step_logits(hf)
    assert rel_err(step_logits(kernelize(hf, backend="cpu")), want) < FP32_RTOL


def test_bf16_kernelized_is_as_close_to_fp32_as_transformers_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = hf_model(hf_config())
    hf.save_pretrained(tmp_path)
    ids = token_ids(hf.config.vocab_size)
    want = _logits(hf, ids)
    bf16 = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    hf_err = median_position_err(_logits(bf16, ids), want)
    our_err = median_position_err(_logits(kernelize(bf16, backend="cpu"), ids), want)
    assert 0 < our_err <= 2 * hf_err + 2e-3, (our_err, hf_err)


def test_kernelize_twice_is_a_no_op():
    hf = kernelize(hf_model(hf_config()), backend="cpu")
    forward = hf.model.layers[0].self_attn.forward
    assert kernelize(hf, backend="cpu") is hf and hf.model.layers[0].self_attn.forward == forward


def test_unrecognised_models_are_named():
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(TypeError, match=r"^model: expected a transformers GlmMoeDsaForCausalLM .* got "
                                        r"LlamaForCausalLM \(model_type 'llama'\)"):
        kernelize(llama)
    with pytest.raises(TypeError, match="got Linear"):
        kernelize(torch.nn.Linear(2, 2))
    hf = hf_model(hf_config())
    hf.model.layers[2].mlp.experts = torch.nn.Identity()
    with pytest.raises(TypeError, match=r"^kernelize: model\.layers\.2\.mlp\.experts: expected a GlmMoeDsaExperts, "
                                        r"got Identity"):
        kernelize(hf)
    assert hf.model.layers[0].self_attn.forward.__func__ is type(hf.model.layers[0].self_attn).forward  # untouched
    with pytest.raises(ValueError, match="attention_dropout"):
        kernelize(hf_model(hf_config(attention_dropout=0.1)))


def test_unavailable_backend_is_refused_with_its_reason():
    unavailable = [name for name, be in registry.backends().items() if not be.available()[0]]
    if not unavailable:
        pytest.skip("every backend is available here")
    with pytest.raises(registry.BackendUnavailableError, match=f"^{unavailable[0]}: "):
        kernelize(hf_model(hf_config()), backend=unavailable[0])
    with pytest.raises(ValueError, match="no-such-backend"):
        kernelize(hf_model(hf_config()), backend="no-such-backend")


def test_a_misspelled_backend_gets_a_did_you_mean():
    with pytest.raises(ValueError, match=r"^backend: expected 'auto' or one of .*got 'cdua'; did you mean 'cuda'\?$"):
        kernelize(hf_model(hf_config()), backend="cdua")
    with pytest.raises(ValueError, match=r"got 'CPU'; did you mean 'cpu'\?$"):
        registry.get_backend("CPU")
    with pytest.raises(ValueError, match=r"got 'quantum'$"):  # nothing close: no guess ('metal' is now near metax)
        registry.get_backend("quantum")


def test_static_cache_runs_transformers_own_attention_and_says_so_once(op_calls):
    """A static cache returns its whole preallocated buffer: those calls run transformers' attention, and one
    warning (per model, not per layer or step) says so."""
    hf = hf_model(hf_config())
    prompt = token_ids(hf.config.vocab_size, seq_len=12)
    want = _greedy(hf, prompt, cache_implementation="static")
    kernelized = kernelize(hf)
    with pytest.warns(UserWarning) as record:
        got = _greedy(kernelized, prompt, cache_implementation="static")
        _greedy(kernelized, prompt, cache_implementation="static")  # the second run says nothing more
    assert torch.equal(got, want)
    assert not {op for op, _ in op_calls} & {"dsa_sparse_prefill", "dsa_sparse_decode", "dsa_indexer_topk"}
    said = [str(w.message) for w in record if "kernelize" in str(w.message)]
    assert len(said) == 1 and "StaticCache" in said[0] and "transformers' own attention" in said[0], said


def test_output_attentions_returns_transformers_weights_and_says_so_once():
    """transformers' test_attention_outputs asks the eager model for its attention weights: the kernelized model
    returns the same ones (each layer's [B, H, T, S], DSA's dropped keys at zero), with one warning."""
    hf = hf_model(hf_config())
    hf.set_attn_implementation("eager")
    ids = token_ids(hf.config.vocab_size)
    with torch.no_grad():
        want = hf(ids, output_attentions=True)
    kernelized = kernelize(hf)
    with pytest.warns(UserWarning) as record, torch.no_grad():
        got = kernelized(ids, output_attentions=True)
        kernelized(ids, output_attentions=True)
    said = [str(w.message) for w in record if "kernelize" in str(w.message)]
    assert len(said) == 1 and "output_attentions" in said[0], said
    assert len(got.attentions) == hf.config.num_hidden_layers == len(want.attentions)
    for g, w in zip(got.attentions, want.attentions):  # the MoE layers are glm5-core's: equal within fp32 error
        assert g.shape == (2, hf.config.num_attention_heads, SEQ_LEN, SEQ_LEN)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert torch.equal(g == 0, w == 0)  # the same keys dropped
    assert (want.attentions[0][..., -1, :] == 0).sum() > SEQ_LEN  # past index_topk: DSA's unselected keys
    assert rel_err(got.logits, want.logits) < FP32_RTOL


def test_kernelize_refuses_transformers_older_than_5_17_in_one_line(monkeypatch):
    """Releases before 5.17 compute another glm_moe_dsa function (docs/transformers.md): kernelize says so."""
    import transformers

    model = hf_model()
    monkeypatch.setattr(transformers, "__version__", "5.16.2")
    with pytest.raises(ImportError) as info:
        kernelize(model)
    message = str(info.value)
    assert "\n" not in message and "transformers >= 5.17" in message and "got transformers 5.16.2" in message
    assert "glm5-core[transformers]" in message
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert kernelize(model) is model


def test_output_attentions_with_sdpa_is_what_transformers_gives():
    """sdpa forms no weights: transformers returns none and warns; the kernelized model does the same (it
    returned an empty tuple with no word)."""
    hf = hf_model(hf_config())
    assert hf.config._attn_implementation == "sdpa"
    ids = token_ids(hf.config.vocab_size)
    kernelized = kernelize(hf)
    with pytest.warns(UserWarning, match="output_attentions=True runs transformers' own \\(sdpa\\)"), torch.no_grad():
        got = kernelized(ids, output_attentions=True)
    assert got.attentions == ()
