"""glm5-core kernels inside a transformers ``GlmMoeDsaForCausalLM`` or ``Glm5NextForConditionalGeneration`` (its
text path: ``glm5_core.integrations.glm5_next_forwards``): ``kernelize(model, backend=None)``.

    from transformers import AutoModelForCausalLM
    from glm5_core.integrations.transformers import kernelize

    model = kernelize(AutoModelForCausalLM.from_pretrained(path), backend="cpu")  # or another backend, None: auto
    model.generate(input_ids, max_new_tokens=32)

Every attention layer's DSA indexer top-k and sparse MLA attention (absorbed, against transformers' own
cache inside ``generate``), every MoE layer's router and routed experts then run glm5-core ops, dispatched
by the registry to ``backend`` (None: the registry's resolution at each call, ``use_backend`` / GLM5_BACKEND /
auto-detection). The modules keep their parameters and buffers (same names, same tensor objects): only
their ``forward`` is replaced (``glm5_core.integrations.glm_moe_dsa_forwards``). Embeddings, norms, dense MLPs,
shared experts and lm_head stay transformers'. Calling ``kernelize`` again is a no-op.

transformers is imported only when ``kernelize`` runs; glm5-core does not need it otherwise.
"""
from __future__ import annotations

import re
import types
from typing import Callable, Optional

import torch

from glm5_core import registry
from glm5_core.integrations import glm_moe_dsa_forwards as forwards

SUPPORTED_ARCHITECTURE = "GlmMoeDsaForCausalLM"
# the first transformers release whose GlmMoeDsa computes the function glm5-core does (docs/transformers.md:
# no shared indexer layers before 5.6, indexer RoPE halves before 5.13, first_k_dense_replace ignored before 5.11,
# a left-padded batch's indexer ignoring the padding before 5.17); setup.py's [transformers] extra pins it
MIN_TRANSFORMERS = (5, 17)
# transformers' experts layout this module reads (use_experts_implementation's attributes) -> expected value
_EXPERTS_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                   "has_post_expert_norm": False, "_is_expert_parallel": False}


def check_transformers_version(version: str) -> None:
    """ImportError in one line when transformers ``version`` computes another GlmMoeDsa function (< 5.17)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) < MIN_TRANSFORMERS:
        want = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"kernelize: expected transformers >= {want} (older releases compute another glm_moe_dsa "
                          f"function), got transformers {version}; install pip install 'glm5-core[transformers]'")


def _transformers_classes() -> dict[str, type]:
    try:
        import transformers
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf
    except ImportError as exc:
        raise ImportError(f"kernelize: needs transformers with glm_moe_dsa (pip install 'glm5-core[transformers]'): "
                          f"{exc}") from None
    check_transformers_version(getattr(transformers, "__version__", "unknown"))
    return {"model": hf.GlmMoeDsaForCausalLM, "attention": hf.GlmMoeDsaAttention, "indexer": hf.GlmMoeDsaIndexer,
            "router": hf.GlmMoeDsaTopkRouter, "experts": hf.GlmMoeDsaExperts, "moe": hf.GlmMoeDsaMoE,
            "mlp": hf.GlmMoeDsaMLP, "decoder": hf.GlmMoeDsaDecoderLayer}


def _check_config(config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"kernelize: config.hidden_act: expected 'silu' (glm5-core's experts are SwiGLU), "
                         f"got {config.hidden_act!r}")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(f"kernelize: config.attention_dropout: expected 0.0 (glm5-core's sparse attention has "
                         f"no dropout), got {config.attention_dropout!r}")


def _check_layers(model, classes: dict[str, type]) -> None:
    """Every decoder layer must be made of the modules this integration has forwards for."""
    for i, layer in enumerate(model.model.layers):
        where = f"model.layers.{i}"
        if type(layer) is not classes["decoder"]:
            raise TypeError(f"kernelize: {where}: expected a GlmMoeDsaDecoderLayer, got {type(layer).__name__}")
        attn = layer.self_attn
        if type(attn) is not classes["attention"]:
            raise TypeError(f"kernelize: {where}.self_attn: expected a GlmMoeDsaAttention, got {type(attn).__name__}")
        if attn.indexer is not None and type(attn.indexer) is not classes["indexer"]:
            raise TypeError(f"kernelize: {where}.self_attn.indexer: expected a GlmMoeDsaIndexer, "
                            f"got {type(attn.indexer).__name__}")
        if type(layer.mlp) is classes["mlp"]:
            continue
        if type(layer.mlp) is not classes["moe"]:
            raise TypeError(f"kernelize: {where}.mlp: expected a GlmMoeDsaMoE or GlmMoeDsaMLP, "
                            f"got {type(layer.mlp).__name__}")
        for name, cls in (("gate", classes["router"]), ("experts", classes["experts"])):
            part = getattr(layer.mlp, name)
            if type(part) is not cls:
                raise TypeError(f"kernelize: {where}.mlp.{name}: expected a {cls.__name__}, got {type(part).__name__}")
        for attr, want in _EXPERTS_LAYOUT.items():
            got = getattr(layer.mlp.experts, attr, want)
            if got != want:
                raise ValueError(f"kernelize: {where}.mlp.experts.{attr}: expected {want!r} (the fused "
                                 f"[gate; up] layout glm5-core reads), got {got!r}")


def _bind(module: torch.nn.Module, forward: Callable, backend: Optional[str]) -> None:
    module.glm5_backend = backend
    module.forward = types.MethodType(forward, module)


def is_kernelized(model: torch.nn.Module) -> bool:
    return any(getattr(m, "glm5_backend", False) is not False for m in model.modules())


NEXT_ARCHITECTURE = "Glm5NextForConditionalGeneration"


def _next_classes() -> Optional[dict[str, type]]:
    try:
        from transformers.models.glm5_next import modeling_glm5_next as hf
    except ImportError:
        return None
    return {"model": hf.Glm5NextForConditionalGeneration, "attention": hf.Glm5NextTextAttention,
            "indexer": hf.Glm5NextTextIndexer, "linear": hf.Glm5NextTextLinearAttention,
            "hc": hf.Glm5NextTextHyperConnection, "router": hf.Glm5NextTextTopkRouter,
            "experts": hf.Glm5NextTextExperts}


def _kernelize_next(model, classes: dict[str, type], backend: Optional[str]):
    """GLM-5.3's text path (``glm5_next_forwards``); the vision tower stays transformers'."""
    from glm5_core.integrations import glm5_next_forwards as next_forwards

    text = model.config.get_text_config()
    _check_config(text)
    if getattr(text, "qk_rope_head_dim", 0):
        raise ValueError(f"kernelize: text_config.qk_rope_head_dim: expected 0 (GLM-5.3's NoPE MLA), "
                         f"got {text.qk_rope_head_dim}")
    if is_kernelized(model):
        return model
    table = ((classes["attention"], next_forwards.attention_forward),
             (classes["indexer"], next_forwards.indexer_forward),
             (classes["linear"], next_forwards.linear_attention_forward),
             (classes["hc"], next_forwards.hyper_connection_forward),
             (classes["router"], forwards.router_forward),
             (classes["experts"], next_forwards.experts_forward))
    for i, layer in enumerate(model.model.language_model.layers):
        experts = getattr(layer.mlp, "experts", None)
        for attr, want in _EXPERTS_LAYOUT.items():
            if experts is not None and getattr(experts, attr, want) != want:
                raise ValueError(f"kernelize: model.language_model.layers.{i}.mlp.experts.{attr}: expected "
                                 f"{want!r} (the fused [gate; up] layout glm5-core reads), got "
                                 f"{getattr(experts, attr)!r}")
    for module in model.model.language_model.modules():
        for cls, forward in table:
            if type(module) is cls:
                _bind(module, forward, backend)
    return model


def kernelize(model, backend: Optional[str] = None):
    """Swap the DSA indexer top-k, sparse MLA attention, MoE router and experts of a transformers
    ``GlmMoeDsaForCausalLM`` for glm5-core ops on ``backend``; returns the same model object.

    TypeError / ValueError name what is not recognised (another architecture, a replaced submodule, an
    experts layout or config value glm5-core does not implement); an unavailable backend raises
    ``registry.BackendUnavailableError`` with its reason."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name (str) or None, got {type(backend).__name__}")
    next_classes = _next_classes()
    if next_classes is not None and type(model) is next_classes["model"]:
        if backend is not None and backend != "auto":
            registry.require_available(backend)
        return _kernelize_next(model, next_classes, backend)
    classes = _transformers_classes()
    if type(model) is not classes["model"]:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        raise TypeError(f"model: expected a transformers {SUPPORTED_ARCHITECTURE} (model_type 'glm_moe_dsa') or "
                        f"{NEXT_ARCHITECTURE}, "
                        f"got {type(model).__name__}" + (f" (model_type {kind!r})" if kind else ""))
    if backend is not None and backend != "auto":
        registry.require_available(backend)
    if is_kernelized(model):
        return model
    _check_config(model.config)
    _check_layers(model, classes)
    notices: set[str] = set()  # the fallbacks already said (once per model), shared by its attention modules
    for module in model.modules():
        if type(module) is classes["attention"]:
            _bind(module, forwards.attention_forward, backend)
            module.glm5_notices = notices
        elif type(module) is classes["router"]:
            _bind(module, forwards.router_forward, backend)
        elif type(module) is classes["experts"]:
            _bind(module, forwards.experts_forward, backend)
    return model
