"""GLM5Config: the model's hyper-parameters, named after the keys of HF ``glm_moe_dsa`` ``config.json``.

HF interop policy (``from_hf_dict`` / ``to_hf_dict``):
  * keys that are fields of GLM5Config map one to one (``rope_parameters.rope_theta`` maps to ``rope_theta``);
    a field missing from the dict takes its default, which is transformers' behaviour where transformers has
    one (``latent_norm_eps``: transformers' ``glm_moe_dsa`` builds q_a_layernorm / kv_a_layernorm with 1e-6);
  * keys that describe behaviour this implementation has fixed (``hidden_act``, ``scoring_func``,
    ``topk_method``, ``rope_parameters.rope_type``, ``attention_bias``, ``attention_dropout``, ...) are checked:
    a value other than the one implemented is REJECTED with a ValueError (loading it silently would compute
    something else);
  * keys transformers derives from the fields (``num_key_value_heads``, ``layer_types``, ``head_dim``,
    ``qk_head_dim``) are checked against them (a value transformers would compute differently with is
    REJECTED) and dropped; ``mlp_layer_types``, which transformers builds its layers from, sets
    ``first_k_dense_replace`` (its "dense" layers must come first); ``to_hf_dict`` writes
    ``num_key_value_heads`` and ``mlp_layer_types`` and lets transformers derive the others;
  * every other key (``architectures``, token ids, ``torch_dtype``, ``transformers_version``, ...) is
    PRESERVED verbatim in ``extra`` and written back by ``to_hf_dict``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from glm5_core.config_schema import TypeProblem, check, field, shown

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
INDEXER_TYPES = ("full", "shared")
# GLM-5.3 (transformers 5.25 models/glm5_next): KDA and indexed (DSA, NoPE MLA) layers with mHC streams
NEXT_MODEL_TYPE = "glm5_next"
NEXT_TEXT_MODEL_TYPE = "glm5_next_text"
NEXT_ARCHITECTURES = ("Glm5NextForConditionalGeneration",)
MODEL_TYPES = (MODEL_TYPE, NEXT_MODEL_TYPE)
NEXT_LAYER_TYPES = ("indexed_attention", "linear_attention")
# the fields only GLM-5.3 (glm5_next) has, with the values a glm_moe_dsa config holds
NEXT_ONLY_DEFAULTS: dict[str, Any] = {
    "layer_types": None, "index_kpool": 1, "index_kpool_always_select_tail": False, "linear_num_heads": 64,
    "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 1,
    "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "swiglu_limit": None}
# transformers' Glm5NextTextConfig defaults (configuration_glm5_next.py, 5.25) where they differ from GLM5Config's
NEXT_HF_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 45, "n_routed_experts": 288, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "qk_nope_head_dim": 256, "max_position_embeddings": 1048576, "index_kpool": 16,
    "index_kpool_always_select_tail": True, "hc_mult": 4, "swiglu_limit": 10.0, "num_nextn_predict_layers": 0}
# keys of a glm5_next text_config this implementation has fixed (value -> why), checked then dropped
_NEXT_FIXED_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu",), "experts, dense MLPs and the KDA conv use SiLU"),
    "attention_bias": ((False,), "projections have no bias"),
    "attention_dropout": ((0.0, 0), "attention dropout is not implemented"),
    "output_router_logits": ((False,), "router logits are not returned"),
}
_NEXT_DROPPED_KEYS = ("num_key_value_heads", "head_dim", "qk_head_dim", "use_cache", "router_aux_loss_coef",
                      "layer_types", "mlp_layer_types")

# Keys whose value must equal what this implementation computes (the key -> (accepted values, why)).
_FIXED_KEYS: dict[str, tuple[tuple[Any, ...], str]] = {
    "model_type": ((MODEL_TYPE,), "only glm_moe_dsa checkpoints are understood"),
    "hidden_act": (("silu",), "experts and dense MLPs are SwiGLU"),
    "scoring_func": (("sigmoid",), "the router uses sigmoid scores"),
    "topk_method": (("noaux_tc",), "routing is aux-loss-free with a selection bias"),
    "attention_bias": ((False,), "projections have no bias"),
    "moe_layer_freq": ((1,), "every layer after first_k_dense_replace is MoE"),
    "rope_scaling": ((None,), "RoPE scaling (YaRN etc.) is not implemented"),
    "use_sliding_window": ((False,), "sliding-window attention is not implemented"),
    "attention_dropout": ((0.0,), "attention dropout is not implemented"),
}
# transformers' glm_moe_dsa builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default epsilon,
# whatever rms_norm_eps says (modeling_glm_moe_dsa.py, 5.6 to 5.24); DeepSeek-V3's reference does the same.
TRANSFORMERS_LATENT_NORM_EPS = 1e-6
DSA_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")  # transformers' names (5.24, 5.11)
_DERIVED_KEYS = ("num_key_value_heads", "mlp_layer_types", "layer_types", "head_dim", "qk_head_dim")
_ROPE_TYPES = (None, "default")

# Upper bounds far above any published model (GLM-5: vocab 154880, 78 layers, 256 experts, 202752 positions),
# so a hostile config.json cannot ask for absurd sizes. Layers and experts are each a Python module, hence
# tighter; any other size is at most MAX_SIZE.
MAX_SIZE = 2 ** 24
MAX_LAYERS = 2 ** 12
MAX_EXPERTS = 2 ** 14



_SIZE = dict(range=(1, MAX_SIZE))
_LAYERS = dict(range=(1, MAX_LAYERS))
_EXPERTS = dict(range=(1, MAX_EXPERTS))
_POSITIVE = dict(range=(0, None), open=("lo",))


@dataclasses.dataclass
class GLM5Config:
    vocab_size: int = field(154880, **_SIZE)
    hidden_size: int = field(6144, **_SIZE)
    num_hidden_layers: int = field(78, **_LAYERS)
    first_k_dense_replace: int = field(3, range=(0, MAX_LAYERS))
    intermediate_size: int = field(12288, **_SIZE)
    moe_intermediate_size: int = field(2048, **_SIZE)
    n_routed_experts: int = field(256, **_EXPERTS)
    n_shared_experts: int = field(1, range=(0, MAX_EXPERTS))
    num_experts_per_tok: int = field(8, **_EXPERTS)
    n_group: int = field(1, **_EXPERTS)
    topk_group: int = field(1, **_EXPERTS)
    routed_scaling_factor: float = field(2.5, **_POSITIVE)
    norm_topk_prob: bool = True
    num_attention_heads: int = field(64, **_SIZE)
    q_lora_rank: int = field(2048, **_SIZE)
    kv_lora_rank: int = field(512, **_SIZE)
    qk_nope_head_dim: int = field(192, **_SIZE)
    qk_rope_head_dim: int = field(64, range=(0, MAX_SIZE))  # 0: NoPE attention (GLM-5.3)
    v_head_dim: int = field(256, **_SIZE)
    rope_theta: float = field(1_000_000.0, **_POSITIVE)
    rope_interleave: bool = True
    index_n_heads: int = field(32, **_SIZE)
    index_head_dim: int = field(128, **_SIZE)
    index_topk: int = field(2048, **_SIZE)
    indexer_rope_interleave: bool = True
    indexer_types: Optional[list[str]] = None  # per main layer; None = all "full"
    num_nextn_predict_layers: int = field(1, range=(0, 1))  # one MTP module, shared across depths
    max_position_embeddings: int = field(202752, **_SIZE)
    rms_norm_eps: float = field(1e-5, **_POSITIVE)
    latent_norm_eps: float = field(TRANSFORMERS_LATENT_NORM_EPS, **_POSITIVE)  # q_a_layernorm and kv_a_layernorm
    tie_word_embeddings: bool = False
    initializer_range: float = field(0.02, **_POSITIVE)
    # ---- GLM-5.3 (glm5_next) fields, transformers' names; on a glm_moe_dsa config they keep NEXT_ONLY_DEFAULTS
    model_type: str = field(MODEL_TYPE, choices=MODEL_TYPES)
    layer_types: Optional[list[str]] = None  # per layer "indexed_attention" | "linear_attention" (KDA)
    index_kpool: int = field(1, range=(1, 2 ** 16))  # the indexer scores pooled groups of this many keys
    index_kpool_always_select_tail: bool = False  # the query's incomplete group is always attended
    linear_num_heads: int = field(64, **_SIZE)
    linear_head_dim: int = field(128, **_SIZE)
    linear_conv_kernel_dim: int = field(4, range=(1, 64))
    linear_lower_bound: Optional[float] = -5.0  # None: softplus forget gate without a lower bound
    hc_mult: int = field(1, range=(1, 64))  # mHC residual streams
    hc_eps: float = field(1e-6, **_POSITIVE)
    hc_sinkhorn_iters: int = field(20, range=(1, 10000))
    swiglu_limit: Optional[float] = None  # clamp of the SwiGLU gate (above) and up (both sides); None: no clamp
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # preserved HF keys

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    def layer_indexer_types(self) -> list[str]:
        return list(self.indexer_types) if self.indexer_types is not None else ["full"] * self.num_hidden_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def is_hybrid(self) -> bool:
        """GLM-5.3 (glm5_next): KDA and indexed layers with mHC streams."""
        return self.model_type == NEXT_MODEL_TYPE

    def layer_kinds(self) -> list[str]:
        """Per main layer: "indexed_attention" (MLA with DSA) or "linear_attention" (KDA)."""
        if self.layer_types is None:
            return ["indexed_attention"] * self.num_hidden_layers
        return ["indexed_attention" if kind == "full_attention" else kind for kind in self.layer_types]

    def full_indexer_layers(self) -> list[int]:
        """The main layers that run their own indexer (indexed layers whose indexer type is "full")."""
        types, kinds = self.layer_indexer_types(), self.layer_kinds()
        return [i for i in range(self.num_hidden_layers) if kinds[i] == "indexed_attention" and types[i] == "full"]

    # ---- validation ----------------------------------------------------------------------------------
    def validate(self) -> GLM5Config:
        """Raise one ValueError (TypeError for a value of the wrong type) naming the first bad field; return self."""
        problems = self.problems()
        if problems:
            raise (TypeError if isinstance(problems[0], TypeProblem) else ValueError)(problems[0])
        return self

    def problems(self, prefix: str = "") -> list[str]:
        """Every problem of the fields (declared above), else of the rules between them; keys start with ``prefix``."""
        problems = check(self, prefix)
        if problems:
            return problems
        return [f"{prefix}{problem}" for problem in self._rule_problems()]

    def _rule_problems(self) -> list[str]:
        experts_kept = (self.n_routed_experts // self.n_group) * self.topk_group
        rules = [
            (self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace: expected <= num_hidden_layers={self.num_hidden_layers}, "
             f"got {self.first_k_dense_replace}"),
            (self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok: expected <= n_routed_experts={self.n_routed_experts}, "
             f"got {self.num_experts_per_tok}"),
            (self.n_routed_experts % self.n_group == 0,
             f"n_group: expected a divisor of n_routed_experts={self.n_routed_experts}, got {self.n_group}"),
            (self.topk_group <= self.n_group, f"topk_group: expected <= n_group={self.n_group}, got {self.topk_group}"),
            (self.num_experts_per_tok <= experts_kept,
             f"num_experts_per_tok: expected <= experts in the kept groups ({experts_kept}), "
             f"got {self.num_experts_per_tok}"),
            (self.qk_rope_head_dim % 2 == 0,
             f"qk_rope_head_dim: expected an even size (RoPE rotates pairs), got {self.qk_rope_head_dim}"),
            (self.index_head_dim >= self.qk_rope_head_dim,
             f"index_head_dim: expected >= qk_rope_head_dim={self.qk_rope_head_dim} (its first qk_rope_head_dim "
             f"dims get RoPE), got {self.index_head_dim}"),
            (self.index_topk <= self.max_position_embeddings,
             f"index_topk: expected <= max_position_embeddings={self.max_position_embeddings} (a query never has "
             f"more keys), got {self.index_topk}"),
        ]
        problems = [message for ok, message in rules if not ok]
        problems += self._next_problems()
        types = self.layer_indexer_types()
        if len(types) != self.num_hidden_layers:
            problems.append(f"indexer_types: expected a list of {self.num_hidden_layers} entries (one per layer: "
                            f"num_hidden_layers={self.num_hidden_layers}), got {shown(self.indexer_types)}")
        problems += [f"indexer_types[{i}]: expected one of {INDEXER_TYPES}, got {shown(kind)}"
                     for i, kind in enumerate(types) if kind not in INDEXER_TYPES]
        if types and types[0] != "full" and not self.is_hybrid:
            problems.append(f"indexer_types[0]: expected 'full' (a 'shared' layer reuses the previous full "
                            f"layer's top-k), got {shown(types[0])}")
        return problems

    def _next_problems(self) -> list[str]:
        """The rules of the glm5_next fields (transformers' validate_architecture and what its layers need)."""
        if not self.is_hybrid:
            return [f"{name}: expected {default!r} (a glm5_next field: set model_type='glm5_next'), "
                    f"got {shown(getattr(self, name))}"
                    for name, default in NEXT_ONLY_DEFAULTS.items() if getattr(self, name) != default]
        problems = []
        if self.qk_rope_head_dim != 0:
            problems.append(f"qk_rope_head_dim: expected 0 (glm5_next's MLA is NoPE), got {self.qk_rope_head_dim}")
        if self.index_topk % self.index_kpool:
            problems.append(f"index_topk: expected a multiple of index_kpool={self.index_kpool}, got {self.index_topk}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            problems.append(f"swiglu_limit: expected a float > 0 or None, got {self.swiglu_limit!r}")
        if self.tie_word_embeddings:
            problems.append("tie_word_embeddings: expected False (glm5_next's lm_head is its own), got True")
        if self.latent_norm_eps != self.rms_norm_eps:
            problems.append(f"latent_norm_eps: expected rms_norm_eps={self.rms_norm_eps} (glm5_next's q_a_layernorm "
                            f"and kv_a_layernorm use it), got {self.latent_norm_eps}")
        kinds = self.layer_types
        if kinds is not None and (not isinstance(kinds, list) or len(kinds) != self.num_hidden_layers):
            return problems + [f"layer_types: expected a list of {self.num_hidden_layers} entries (one per layer), "
                               f"got {shown(kinds)}"]
        bad = [(i, k) for i, k in enumerate(self.layer_kinds()) if k not in NEXT_LAYER_TYPES]
        if bad:
            return problems + [f"layer_types[{bad[0][0]}]: expected one of {NEXT_LAYER_TYPES}, got {shown(bad[0][1])}"]
        kinds, types = self.layer_kinds(), self.layer_indexer_types()
        if len(types) != self.num_hidden_layers:
            return problems  # reported by _rule_problems
        for i in range(self.num_hidden_layers):
            if kinds[i] == "indexed_attention" and types[i] == "shared" and (
                    i == 0 or kinds[i - 1] != "indexed_attention" or types[i - 1] != "full"):
                problems.append(f"indexer_types[{i}]: expected 'full' (a 'shared' indexed layer reuses the top-k "
                                f"of the layer just before it, which must be an indexed 'full' layer), got 'shared'")
        return problems

    # ---- HF config.json ------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> GLM5Config:
        """Build from a ``config.json`` dict (see the module docstring for the key policy)."""
        if not isinstance(d, dict):
            raise TypeError(f"config: expected a dict (parsed config.json), got {type(d).__name__}")
        if d.get("model_type") in (NEXT_MODEL_TYPE, NEXT_TEXT_MODEL_TYPE):
            return cls._from_next_dict(d)
        d = dict(d)
        for key, (accepted, why) in _FIXED_KEYS.items():
            if key in d and d[key] not in accepted:
                raise ValueError(f"{key}: expected {' or '.join(repr(a) for a in accepted)} ({why}), got {d[key]!r}")
            d.pop(key, None)
        if d.get("architectures") == list(ARCHITECTURES):
            d.pop("architectures")  # to_hf_dict writes it
        kwargs: dict[str, Any] = {}
        rope = d.pop("rope_parameters", None)
        if rope is not None:
            if not isinstance(rope, dict):
                raise ValueError(f"rope_parameters: expected a dict, got {type(rope).__name__}")
            rope = dict(rope)
            if rope.get("rope_type") not in _ROPE_TYPES:
                raise ValueError(f"rope_parameters.rope_type: expected 'default' (scaled RoPE is not implemented), "
                                 f"got {rope.get('rope_type')!r}")
            rope.pop("rope_type", None)
            if "rope_theta" in rope:
                kwargs["rope_theta"] = rope.pop("rope_theta")
            if rope:
                raise ValueError(f"rope_parameters: unsupported keys {sorted(rope)} (only rope_type, rope_theta)")
        names = set(cls.field_names()) - set(NEXT_ONLY_DEFAULTS) - {"model_type"}
        for key in list(d):
            if key in names:
                kwargs[key] = d.pop(key)
        if "rope_theta" in kwargs and isinstance(kwargs["rope_theta"], int):
            kwargs["rope_theta"] = float(kwargs["rope_theta"])
        if isinstance(kwargs.get("indexer_types"), (list, tuple)):
            kwargs["indexer_types"] = list(kwargs["indexer_types"])  # a copy: the config does not alias d
        derived = {key: d.pop(key) for key in _DERIVED_KEYS if key in d}
        derived = {key: value for key, value in derived.items() if value is not None}  # None: transformers derives
        if "mlp_layer_types" in derived:  # what transformers builds its layers from (5.6 has no first_k_dense_replace)
            kwargs["first_k_dense_replace"] = _dense_prefix(derived["mlp_layer_types"])
        cfg = cls(**kwargs, extra=d).validate()
        cfg._check_derived(derived)
        return cfg

    def transformers_derived(self) -> dict[str, Any]:
        """The keys transformers' GlmMoeDsaConfig derives from the fields, as it derives them."""
        n_dense = self.first_k_dense_replace
        return {"num_key_value_heads": self.num_attention_heads,
                "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense),
                "layer_types": ["indexed_attention"] * self.num_hidden_layers,
                "head_dim": self.qk_rope_head_dim, "qk_head_dim": self.qk_head_dim}

    def _check_derived(self, given: dict[str, Any]) -> None:
        """ValueError for a derived key transformers would run with a value this config does not compute."""
        want = self.transformers_derived()
        why = {"num_key_value_heads": f"MLA expands every head from the shared latent: expected "
                                      f"num_attention_heads={self.num_attention_heads}",
               "mlp_layer_types": f"expected {self.num_hidden_layers} entries",
               "layer_types": f"expected one of {DSA_LAYER_TYPES} (DSA) for all {self.num_hidden_layers} layers"}
        for key in ("num_key_value_heads", "mlp_layer_types"):  # head_dim / qk_head_dim: transformers recomputes
            if key in given and given[key] != want[key]:
                raise ValueError(f"{key}: {why[key]}, got {given[key]!r}")
        layer_types = given.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != self.num_hidden_layers
                                        or any(t not in DSA_LAYER_TYPES for t in layer_types)):
            raise ValueError(f"layer_types: {why['layer_types']}, got {layer_types!r}")

    @classmethod
    def _from_next_dict(cls, d: dict[str, Any]) -> GLM5Config:
        """A transformers ``glm5_next`` config.json (``Glm5NextForConditionalGeneration``: the text fields in
        ``text_config``, or flat as GLM-5.3-Flash's text-only checkpoints store them) or a ``glm5_next_text`` one.
        Missing keys take transformers' defaults (Glm5NextTextConfig.__post_init__, 5.25); the outer keys
        (vision_config, token ids, ...) are kept in ``extra``, the text config's unknown ones in
        ``extra["text_config"]``."""
        outer = dict(d)
        if outer.get("model_type") == NEXT_TEXT_MODEL_TYPE:
            text, outer = outer, {}
        else:
            text = outer.pop("text_config", None)
            if text is None:  # flat: transformers forwards the top-level keys to the text config
                text, outer = outer, {k: outer[k] for k in ("vision_config",) if k in outer}
            elif not isinstance(text, dict):
                raise ValueError(f"text_config: expected a dict, got {type(text).__name__}")
            if outer.get("architectures") == list(NEXT_ARCHITECTURES):
                outer.pop("architectures")
            outer.pop("model_type", None)
        text = dict(text)
        text.pop("model_type", None)
        text.pop("architectures", None)
        for key, (accepted, why) in _NEXT_FIXED_KEYS.items():
            if key in text and text[key] not in accepted:
                raise ValueError(f"text_config.{key}: expected {accepted[0]!r} ({why}), got {text[key]!r}")
            text.pop(key, None)
        if "linear_attn_config" in text:  # transformers' older nested form
            linear = text.pop("linear_attn_config")
            if not isinstance(linear, dict):
                raise ValueError(f"text_config.linear_attn_config: expected a dict, got {type(linear).__name__}")
            for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                              ("short_conv_kernel_size", "linear_conv_kernel_dim"),
                              ("gate_lower_bound", "linear_lower_bound")):
                if key in linear:
                    text.setdefault(name, linear[key])
            if linear.get("safe_gate", True) and text.get("linear_lower_bound", -5.0) is None:
                text["linear_lower_bound"] = -5.0
        kwargs: dict[str, Any] = dict(NEXT_HF_DEFAULTS, model_type=NEXT_MODEL_TYPE)
        names = set(cls.field_names()) - {"rope_theta", "rope_interleave", "indexer_rope_interleave",
                                          "latent_norm_eps", "first_k_dense_replace", "model_type"}
        for key in list(text):
            if key in names:
                kwargs[key] = text.pop(key)
        n = kwargs["num_hidden_layers"]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LAYERS:
            raise ValueError(f"text_config.num_hidden_layers: expected an int in [1, {MAX_LAYERS}], got {n!r:.40}")
        mlp_types = text.pop("mlp_layer_types", None)
        kwargs["first_k_dense_replace"] = (_dense_prefix(mlp_types) if mlp_types is not None else min(3, n))
        if kwargs.get("layer_types") is None:
            kwargs["layer_types"] = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if isinstance(kwargs["layer_types"], list):
            kwargs["layer_types"] = ["indexed_attention" if t == "full_attention" else t for t in kwargs["layer_types"]]
        if kwargs.get("indexer_types") is None:
            pattern = text.pop("index_topk_pattern", None)
            freq, offset = text.pop("index_topk_freq", 1), text.pop("index_skip_topk_offset", 2)
            if isinstance(pattern, str):
                if set(pattern) - {"F", "S"}:
                    raise ValueError(f"text_config.index_topk_pattern: expected a string of 'F' / 'S', "
                                     f"got {pattern!r:.60}")
                kwargs["indexer_types"] = [{"F": "full", "S": "shared"}[c] for c in pattern]
            elif pattern is not None:
                kwargs["indexer_types"] = list(pattern)
            else:
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in (freq, offset)):
                    raise ValueError(f"text_config.index_topk_freq / index_skip_topk_offset: expected ints, "
                                     f"got {freq!r:.20} / {offset!r:.20}")
                freq = max(freq, 1)
                kwargs["indexer_types"] = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                                           for i in range(n)]
        elif isinstance(kwargs["indexer_types"], (list, tuple)):
            kwargs["indexer_types"] = list(kwargs["indexer_types"])
        if isinstance(kwargs.get("rms_norm_eps"), (int, float)) and not isinstance(kwargs["rms_norm_eps"], bool):
            kwargs["latent_norm_eps"] = kwargs["rms_norm_eps"]
        else:
            kwargs["latent_norm_eps"] = kwargs.get("rms_norm_eps", cls.rms_norm_eps)
        heads = text.pop("num_key_value_heads", None)
        for key in _NEXT_DROPPED_KEYS:
            text.pop(key, None)
        extra = dict(outer)
        if text:
            extra["text_config"] = text
        cfg = cls(**kwargs, extra=extra).validate()
        if heads is not None and heads != cfg.num_attention_heads:
            raise ValueError(f"text_config.num_key_value_heads: expected num_attention_heads="
                             f"{cfg.num_attention_heads} (MLA expands every head from the latent), got {heads!r}")
        return cfg

    def _to_next_dict(self) -> dict[str, Any]:
        """transformers' ``Glm5NextForConditionalGeneration`` config.json: the fields in ``text_config``."""
        outer = {k: v for k, v in self.extra.items() if k != "text_config"}
        text: dict[str, Any] = dict(self.extra.get("text_config", {}))
        text["model_type"] = NEXT_TEXT_MODEL_TYPE
        text.update({key: accepted[0] for key, (accepted, _) in _NEXT_FIXED_KEYS.items()})
        skip = {"rope_theta", "rope_interleave", "indexer_rope_interleave", "latent_norm_eps",
                "first_k_dense_replace", "model_type"}
        for name in self.field_names():
            if name not in skip:
                value = getattr(self, name)
                text[name] = list(value) if isinstance(value, list) else value
        n, n_dense = self.num_hidden_layers, self.first_k_dense_replace
        text["layer_types"] = self.layer_kinds()
        text["indexer_types"] = self.layer_indexer_types()
        text["mlp_layer_types"] = ["dense"] * n_dense + ["sparse"] * (n - n_dense)
        text["num_key_value_heads"] = self.num_attention_heads
        out: dict[str, Any] = {"architectures": list(NEXT_ARCHITECTURES), "model_type": NEXT_MODEL_TYPE}
        out.update(outer)
        out["model_type"] = NEXT_MODEL_TYPE
        out["tie_word_embeddings"] = self.tie_word_embeddings
        out["text_config"] = text
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict: preserved keys, then every field (``rope_theta`` inside rope_parameters)."""
        if self.is_hybrid:
            return self._to_next_dict()
        out: dict[str, Any] = {"architectures": list(ARCHITECTURES), "model_type": MODEL_TYPE}
        out.update(self.extra)
        out["model_type"] = MODEL_TYPE
        out.update({key: accepted[0] for key, (accepted, _) in _FIXED_KEYS.items()})  # what is implemented
        for name in self.field_names():
            if name == "rope_theta" or name in NEXT_ONLY_DEFAULTS or name == "model_type":
                continue
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, list) else value
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        # transformers derives the others itself; it defaults num_key_value_heads to 64, and 5.6 builds 3 dense
        # layers whatever first_k_dense_replace says
        derived = self.transformers_derived()
        out["num_key_value_heads"], out["mlp_layer_types"] = derived["num_key_value_heads"], derived["mlp_layer_types"]
        return out

    # ---- presets -------------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> GLM5Config:
        """A CPU training preset: byte-level vocab (256 + 8 specials), 4 layers (1 dense + 3 MoE), sparse at seq 128.

        Its latent norms use 1e-5 like its other norms (the Quickstart's numerics since the first release);
        ``save_pretrained`` folds the difference to transformers' 1e-6 into the projections."""
        base = dict(
            vocab_size=264, hidden_size=128, num_hidden_layers=4, first_k_dense_replace=1,
            intermediate_size=384, moe_intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, rope_theta=10000.0, index_n_heads=4, index_head_dim=16, index_topk=32,
            indexer_types=["full", "full", "shared", "full"], num_nextn_predict_layers=1,
            max_position_embeddings=512, rms_norm_eps=1e-5, latent_norm_eps=1e-5, tie_word_embeddings=False,
            initializer_range=0.02,
        )
        base.update(overrides)
        return cls(**base).validate()

    @classmethod
    def tiny_glm53(cls, **overrides: Any) -> GLM5Config:
        """A CPU training preset of GLM-5.3's architecture (glm5_next): byte-level vocab, 4 layers (KDA, KDA,
        indexed with its own k-pool indexer, indexed sharing its top-k; 1 dense + 3 MoE), 4 mHC streams, NoPE
        MLA, clamped SwiGLU, one MTP module; sparse at seq 128 (index_topk 32 in groups of 4)."""
        base = dict(
            vocab_size=264, hidden_size=128, num_hidden_layers=4, first_k_dense_replace=1,
            intermediate_size=384, moe_intermediate_size=96, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0,
            v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=32, max_position_embeddings=512,
            indexer_types=["full", "full", "full", "shared"], num_nextn_predict_layers=1, rms_norm_eps=1e-5,
            latent_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02, model_type=NEXT_MODEL_TYPE,
            layer_types=["linear_attention", "linear_attention", "indexed_attention", "indexed_attention"],
            index_kpool=4, index_kpool_always_select_tail=True, linear_num_heads=4, linear_head_dim=16,
            linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
            swiglu_limit=10.0,
        )
        base.update(overrides)
        return cls(**base).validate()

    @classmethod
    def glm5(cls) -> GLM5Config:
        """GLM-5's published architecture (HF zai-org/GLM-5 config.json).
        For config round-trips only: never instantiate a model."""
        return cls().validate()

    def replace(self, **changes: Any) -> GLM5Config:
        return dataclasses.replace(self, **changes).validate()


def _dense_prefix(mlp_layer_types: Any) -> int:
    """The number of leading "dense" layers of transformers' ``mlp_layer_types``, which must be all "dense"
    then all "sparse" (MoE): glm5-core's layout (first_k_dense_replace dense layers, then MoE)."""
    if not isinstance(mlp_layer_types, list) or any(t not in ("dense", "sparse") for t in mlp_layer_types):
        raise ValueError(f"mlp_layer_types: expected a list of 'dense' / 'sparse', got {mlp_layer_types!r}")
    n_dense = mlp_layer_types.count("dense")
    if mlp_layer_types[:n_dense] != ["dense"] * n_dense:
        raise ValueError(f"mlp_layer_types: expected the 'dense' layers first, then the 'sparse' (MoE) ones "
                         f"(glm5-core's first_k_dense_replace layout), got {mlp_layer_types!r}")
    return n_dense
