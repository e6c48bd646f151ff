"""SGLang clients' default sampling parameters, and values that used to be coerced or crash the parser."""
import pytest

from glm5_core.rl.serving.protocol import NEUTRAL_PARAMS, Limits, parse_generate_request

LIMITS = Limits(vocab_size=300, max_input_tokens=100, max_new_tokens=50)


def _parse(**fields):
    return parse_generate_request({"input_ids": [1, 2, 3], **fields}, LIMITS)


def test_slime_style_defaults_are_accepted_and_change_nothing():
    plain = _parse(sampling_params={"temperature": 0.7, "max_new_tokens": 9}, rid="t")
    slime = _parse(rid="t", sampling_params={
        "temperature": 0.7, "max_new_tokens": 9, "top_k": -1, "min_p": 0.0, "stop": [], "n": 1,
        "skip_special_tokens": False, "spaces_between_special_tokens": False, "no_stop_trim": True,
        "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": True,
        "min_new_tokens": 0})
    assert slime == plain


@pytest.mark.parametrize("name", sorted(NEUTRAL_PARAMS))
def test_features_we_do_not_implement_are_refused_not_ignored(name):
    active = {"top_k": 20, "min_p": 0.1, "min_new_tokens": 3, "n": 4, "repetition_penalty": 1.2,
              "frequency_penalty": 0.5, "presence_penalty": 0.5, "ignore_eos": False, "stop": ["\n"],
              "skip_special_tokens": "yes", "spaces_between_special_tokens": 1, "no_stop_trim": None,
              "stop_regex": "x+", "json_schema": "{}", "regex": "a", "ebnf": "r", "structural_tag": "t",
              "logit_bias": {"1": 2.0}, "custom_params": {"a": 1}, "beam_width": 2, "watermark": {"enabled": True},
              "choice": ["a"], "stream_interval": 4}[name]
    with pytest.raises(ValueError, match=f"sampling_params.{name}"):
        _parse(sampling_params={name: active})


@pytest.mark.parametrize("fields, field", [
    (dict(sampling_params=0), "sampling_params"),  # was coerced to {}
    (dict(sampling_params=[]), "sampling_params"),
    (dict(rid=0), "rid"),  # was replaced by a random id
    (dict(rid=""), "rid"),
    (dict(sampling_params={"stop_token_ids": 0}), "stop_token_ids"),  # was coerced to []
    (dict(sampling_params={"temperature": 10**400}), "temperature"),  # was an OverflowError (a 413)
    (dict(sampling_params={"top_p": -10**400}), "top_p"),
    (dict(sampling_params={"top_k": True}), "top_k"),  # True == 1 in Python: not a neutral top_k
])
def test_values_are_type_checked_before_defaults_apply(fields, field):
    with pytest.raises(ValueError, match=field):
        _parse(**fields)


def test_absent_and_null_fields_take_their_defaults():
    request = _parse(sampling_params=None, rid=None)
    assert request.temperature == 1.0 and request.stop_token_ids == () and len(request.rid) == 32
    assert _parse(sampling_params={"stop_token_ids": None}).stop_token_ids == ()


def test_ignore_eos_false_needs_the_stop_tokens_spelled_out():
    """SGLang stops at the tokenizer's EOS unless ignore_eos; this engine knows no EOS, only stop_token_ids."""
    with pytest.raises(ValueError, match="ignore_eos"):
        _parse(sampling_params={"ignore_eos": False})
    request = _parse(sampling_params={"ignore_eos": False, "stop_token_ids": [2]})
    assert request.stop_token_ids == (2,)
