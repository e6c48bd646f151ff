"""What transformers' ``glm_moe_dsa`` writes and computes, where it differs from glm5-core's own layout.

Read from transformers' source (``models/glm_moe_dsa/modeling_glm_moe_dsa.py`` and ``conversion_mapping.py``,
5.17 to 5.24, the versions tested). Legend: E experts, F moe_intermediate_size, D hidden_size, H heads,
Hi index_n_heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim, Di index_head_dim, C kv_lora_rank, Q q_lora_rank.

Loading (transformers -> glm5-core):
  * ``save_pretrained(save_original_format=False)`` stores each MoE layer's experts fused:
    ``mlp.experts.gate_up_proj`` [E, 2F, D] (gate rows first) and ``mlp.experts.down_proj`` [E, D, F];
    :func:`split_fused_specs` / :func:`split_fused_tensors` turn them into glm5-core's per-expert names.
  * a bf16 / fp16 checkpoint keeps the router weight in fp32 (``_keep_in_fp32_modules_strict``), and an
    fp16 one the indexer's weights_proj (``_keep_in_fp32_modules``): :func:`keeps_fp32` names them.
  * with ``n_shared_experts: 0`` transformers still builds the shared-expert MLP, with zero-width weights
    ([0, D], [D, 0]); glm5-core has no module there, so :func:`drop_empty` drops them.

Exporting (glm5-core -> transformers), :func:`to_transformers_form`, exact in real arithmetic (and the
zero-width shared-expert weights transformers expects when ``n_shared_experts`` is 0):
  * transformers builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever the config says. Since
    RMSNorm_e2(c x) = RMSNorm_e1(x) for c = sqrt(e2 / e1), a model with another ``latent_norm_eps`` e1 is
    written with q_a_proj and the latent rows of kv_a_proj_with_mqa scaled by c (one rounding per weight);
  * transformers rotates interleaved pairs (x[2i], x[2i+1]) in MLA and in the indexer; a model that rotates
    halves (x[i], x[i + Dr/2]) is written with its rope rows permuted to that order (no rounding at all):
    the rotated values, hence every dot product, are then the same.
"""
from __future__ import annotations

import math
import re

import torch

from glm5_core.model.config import MAX_EXPERTS, TRANSFORMERS_LATENT_NORM_EPS, GLM5Config

TensorSpec = tuple[tuple[int, ...], torch.dtype]
_FUSED_RE = re.compile(r"^(model\.layers\.\d{1,9}\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_FP32_KEPT_SUFFIXES = (".mlp.gate.weight", ".self_attn.indexer.weights_proj.weight",
                       # glm5_next (_keep_in_fp32_modules_strict): the KDA conv and forget gate, the mHC biases
                       ".self_attn.conv1d.weight", ".forget_gate.dt_bias", ".forget_gate.A_log", ".attn_hc.base",
                       ".attn_hc.scale", ".ffn_hc.base", ".ffn_hc.scale")
_SHARED_EXPERT_RE = re.compile(r"^model\.layers\.\d{1,9}\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$")


# ---- loading ------------------------------------------------------------------------------------------
def keeps_fp32(name: str) -> bool:
    """Tensors transformers keeps in fp32 in a lower-precision checkpoint (loaded as stored)."""
    return name.endswith(_FP32_KEPT_SUFFIXES)


def drop_empty(entries: dict[str, TensorSpec | torch.Tensor]) -> dict[str, TensorSpec | torch.Tensor]:
    """Specs or tensors without the zero-width shared-expert weights of an ``n_shared_experts: 0`` model."""
    def empty(entry) -> bool:
        shape = entry.shape if isinstance(entry, torch.Tensor) else entry[0]
        return math.prod(shape) == 0
    return {name: entry for name, entry in entries.items() if not (_SHARED_EXPERT_RE.match(name) and empty(entry))}


def _split_names(prefix: str, kind: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Per-expert names and shapes of one fused tensor (ValueError for a shape that cannot be one)."""
    name = f"{prefix}.{kind}"
    if len(shape) != 3 or (kind == "gate_up_proj" and shape[1] % 2):
        want = "[E, 2F, D]" if kind == "gate_up_proj" else "[E, D, F]"
        raise ValueError(f"checkpoint: {name}: expected a fused expert tensor {want}, got shape {list(shape)}")
    if shape[0] > MAX_EXPERTS:
        raise ValueError(f"checkpoint: {name}: expected at most {MAX_EXPERTS} experts, got {shape[0]}")
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": shape[1:] for e in range(shape[0])}
    half = (shape[1] // 2, shape[2])
    return {f"{prefix}.{e}.{proj}.weight": half for e in range(shape[0]) for proj in ("gate_proj", "up_proj")}


def split_fused_specs(specs: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
    """Header specs with every fused expert tensor replaced by its per-expert entries."""
    out: dict[str, TensorSpec] = {}
    for name, (shape, dtype) in specs.items():
        match = _FUSED_RE.match(name)
        parts = _split_names(match.group(1), match.group(2), shape) if match else {name: shape}
        for part, part_shape in parts.items():
            if part in out or part in specs and part != name:
                raise ValueError(f"checkpoint: {part} is stored twice (fused and per expert)")
            out[part] = (tuple(part_shape), dtype)
    return out


def split_fused_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors with every fused expert tensor replaced by per-expert views of it (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _FUSED_RE.match(name)
        if not match:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]  # [D, F]
            else:
                gate, up = tensor[e].chunk(2, dim=0)  # [F, D] each: transformers' gate, up = ... .chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out


# ---- exporting ----------------------------------------------------------------------------------------
def halves_to_pairs(rope_dim: int) -> torch.Tensor:
    """Permutation p of the rope dims with x_pairs = x_halves[p]: pair i = (x[i], x[i + Dr/2]) -> (2i, 2i+1)."""
    half = torch.arange(rope_dim // 2)
    return torch.stack((half, half + rope_dim // 2), dim=-1).flatten()  # [Dr]


def _permute_rows(weight: torch.Tensor, block: int, start: int, perm: torch.Tensor) -> torch.Tensor:
    """Rows start .. start+len(perm) of every ``block`` rows, permuted (weight [n * block, cols] or [n * block])."""
    blocks = weight.reshape(-1, block, *weight.shape[1:]).clone()  # [n, block, ...]
    blocks[:, start:start + perm.numel()] = blocks[:, start + perm]
    return blocks.reshape(weight.shape)


def _scale_rows(weight: torch.Tensor, rows: int, factor: float) -> torch.Tensor:
    """The first ``rows`` rows times ``factor``, computed in fp64 and rounded once."""
    out = weight.clone()
    out[:rows] = (weight[:rows].double() * factor).to(weight.dtype)
    return out


def to_transformers_form(cfg: GLM5Config, state: dict[str, torch.Tensor]
                         ) -> tuple[GLM5Config, dict[str, torch.Tensor]]:
    """(config, tensors) computing the same function the way transformers computes: latent_norm_eps 1e-6 and
    interleaved RoPE. Tensors already in that form are returned as they are (a bitwise round trip)."""
    scale = math.sqrt(TRANSFORMERS_LATENT_NORM_EPS / cfg.latent_norm_eps)
    rescale = cfg.latent_norm_eps != TRANSFORMERS_LATENT_NORM_EPS
    perm = halves_to_pairs(cfg.qk_rope_head_dim)
    Dn, Dr, C = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    out = dict(state)
    for name, weight in state.items():
        if name.endswith(".self_attn.q_a_proj.weight") and rescale:
            out[name] = _scale_rows(weight, weight.shape[0], scale)
        elif name.endswith(".self_attn.kv_a_proj_with_mqa.weight"):
            if rescale:
                weight = _scale_rows(weight, C, scale)  # the latent rows only: k_pe is not normalised
            out[name] = weight if cfg.rope_interleave else _permute_rows(weight, C + Dr, C, perm)
        elif name.endswith(".self_attn.q_b_proj.weight") and not cfg.rope_interleave:
            out[name] = _permute_rows(weight, Dn + Dr, Dn, perm)  # per head: [Dn nope rows, Dr rope rows]
        elif not cfg.indexer_rope_interleave and name.endswith(".self_attn.indexer.wq_b.weight"):
            out[name] = _permute_rows(weight, cfg.index_head_dim, 0, perm)  # per head: rope rows first
        elif not cfg.indexer_rope_interleave and re.search(r"\.self_attn\.indexer\.(wk\.weight|k_norm\.(weight|bias))$",
                                                           name):
            out[name] = _permute_rows(weight, cfg.index_head_dim, 0, perm)  # k's rope dims (and k_norm's)
    if cfg.n_shared_experts == 0:  # transformers' zero-width shared experts, so it reports no missing key
        like = state["model.embed_tokens.weight"]
        n_layers = cfg.num_hidden_layers + (1 if cfg.num_nextn_predict_layers else 0)
        for layer in range(cfg.first_k_dense_replace, n_layers):
            prefix = f"model.layers.{layer}.mlp.shared_experts"
            for proj, shape in (("gate_proj", (0, cfg.hidden_size)), ("up_proj", (0, cfg.hidden_size)),
                                ("down_proj", (cfg.hidden_size, 0))):
                out[f"{prefix}.{proj}.weight"] = like.new_zeros(shape)
    form = cfg.replace(latent_norm_eps=TRANSFORMERS_LATENT_NORM_EPS, rope_interleave=True,
                       indexer_rope_interleave=True)
    return form, out


# ---- GLM-5.3 (transformers glm5_next) -------------------------------------------------------------------
# transformers' Glm5NextForConditionalGeneration stores the language model under model.language_model.* and the
# vision tower under model.visual.*; GLM-5.3's published (original) layout stores it flat (model.layers.*) with
# the names transformers' conversion_mapping.py ("glm5_next", 5.25) renames on load:
_NEXT_RENAMES = ((".self_attn.f_a_proj.", ".self_attn.forget_gate.f_a_proj."),
                 (".self_attn.f_b_proj.", ".self_attn.forget_gate.f_b_proj."),
                 (".self_attn.dt_bias", ".self_attn.forget_gate.dt_bias"),
                 (".self_attn.A_log", ".self_attn.forget_gate.A_log"),
                 (".hc_attn_fn", ".attn_hc.fn"), (".hc_attn_base", ".attn_hc.base"),
                 (".hc_attn_scale", ".attn_hc.scale"), (".hc_ffn_fn", ".ffn_hc.fn"),
                 (".hc_ffn_base", ".ffn_hc.base"), (".hc_ffn_scale", ".ffn_hc.scale"))
_SPLIT_CONV_RE = re.compile(r"^(model\.layers\.\d{1,9}\.self_attn\.)([qkv])_conv1d\.weight$")
NEXT_PREFIX = "model.language_model."
NEXT_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


def next_name(name: str) -> str | None:
    """glm5-core's name of a glm5_next checkpoint tensor; None for a vision-tower tensor (skipped)."""
    if name.startswith(NEXT_VISION_PREFIXES):
        return None
    if name.startswith(NEXT_PREFIX):
        name = "model." + name[len(NEXT_PREFIX):]
    for old, new in _NEXT_RENAMES:
        if old in name and new not in name:
            name = name.replace(old, new)
    return name


def next_entries(entries: dict[str, TensorSpec | torch.Tensor]
                 ) -> tuple[dict[str, TensorSpec | torch.Tensor], int]:
    """Specs or tensors of a glm5_next checkpoint under glm5-core's names (the original layout's q / k / v
    conv weights concatenated as transformers does), and how many vision tensors were skipped."""
    out: dict[str, TensorSpec | torch.Tensor] = {}
    convs: dict[str, dict[str, TensorSpec | torch.Tensor]] = {}
    skipped = 0
    for name, entry in entries.items():
        new = next_name(name)
        if new is None:
            skipped += 1
            continue
        match = _SPLIT_CONV_RE.match(new)
        if match:
            convs.setdefault(match.group(1), {})[match.group(2)] = entry
            continue
        if new in out:
            raise ValueError(f"checkpoint: {new} is stored twice (as {name} and under another name)")
        out[new] = entry
    for prefix, parts in convs.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"checkpoint: {prefix}[qkv]_conv1d.weight: expected all three, got {sorted(parts)}")
        name = prefix + "conv1d.weight"
        if name in out:
            raise ValueError(f"checkpoint: {name} is stored twice (fused and as q / k / v)")
        q, k, v = parts["q"], parts["k"], parts["v"]
        if isinstance(q, torch.Tensor):
            out[name] = torch.cat((q, k, v), dim=0)
        else:
            shapes = {spec[0][1:] for spec in (q, k, v)} | set()
            dtypes = {spec[1] for spec in (q, k, v)}
            if len(shapes) != 1 or len(dtypes) != 1 or not q[0]:
                raise ValueError(f"checkpoint: {prefix}[qkv]_conv1d.weight: expected equal shapes and dtypes, got "
                                 f"{[list(s[0]) for s in (q, k, v)]}")
            out[name] = ((q[0][0] + k[0][0] + v[0][0], *q[0][1:]), q[1])
    return out, skipped


def to_next_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """glm5-core's tensors under transformers' Glm5NextForConditionalGeneration names (the language model)."""
    return {(NEXT_PREFIX + name[len("model."):] if name.startswith("model.") else name): t
            for name, t in state.items()}


# ---- block-FP8 checkpoints (quantization_config.quant_method "fp8", per-block weight_scale_inv) -------------
FP8_SCALE_SUFFIX = "_scale_inv"  # weight name + this: fp32 [ceil(out / bo), ceil(in / bi)]
MAX_FP8_BLOCK = 2 ** 16


def fp8_block_size(quantization_config) -> tuple[int, int] | None:
    """The (rows, cols) block of a ``fp8`` quantization_config; None without one; ValueError naming any other
    method (only block-FP8 with per-block scales, GLM-5.3's published form, is dequantized)."""
    if quantization_config is None:
        return None
    if not isinstance(quantization_config, dict):
        raise ValueError(f"quantization_config: expected a dict, got {type(quantization_config).__name__}")
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method: expected 'fp8' (block-FP8 is dequantized on load; no "
                         f"other quantization is supported), got {method!r:.60}")
    fmt = quantization_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt: expected 'e4m3', got {fmt!r:.40}")
    block = quantization_config.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_FP8_BLOCK for b in block)):
        raise ValueError(f"quantization_config.weight_block_size: expected [rows, cols] of ints in "
                         f"[1, {MAX_FP8_BLOCK}], got {block!r:.60}")
    return int(block[0]), int(block[1])


def fp8_specs(specs: dict[str, TensorSpec], block: tuple[int, int], dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Header specs with each fp8 weight (and its scale) replaced by the dequantized weight's spec in ``dtype``;
    every scale's shape checked against its weight's before anything is read."""
    out: dict[str, TensorSpec] = {}
    for name, (shape, dt) in specs.items():
        if name.endswith(FP8_SCALE_SUFFIX):
            weight = name[:-len(FP8_SCALE_SUFFIX)]
            if weight not in specs:
                raise ValueError(f"checkpoint: {name}: a scale without its weight {weight}")
            continue
        scale = specs.get(name + FP8_SCALE_SUFFIX)
        if dt == torch.float8_e4m3fn:
            if scale is None:
                raise ValueError(f"checkpoint: {name}: an fp8 weight without {name + FP8_SCALE_SUFFIX}")
            if len(shape) != 2:
                raise ValueError(f"checkpoint: {name}: expected a 2-d fp8 weight, got shape {list(shape)}")
            want = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
            if tuple(scale[0]) != want or scale[1] != torch.float32:
                raise ValueError(f"checkpoint: {name + FP8_SCALE_SUFFIX}: expected float32 {list(want)} (blocks of "
                                 f"{list(block)} over {list(shape)}), got {scale[1]} {list(scale[0])}")
            out[name] = (shape, dtype)
        elif scale is not None:
            raise ValueError(f"checkpoint: {name}: has a scale but is {dt}, not float8_e4m3fn")
        else:
            out[name] = (shape, dt)
    return out


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """weight fp8 [out, in] times its block's scale (fp32), rounded once to ``dtype``."""
    rows, cols = weight.shape
    scale = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.to(torch.float32) * scale).to(dtype)


def fp8_tensors(tensors: dict[str, torch.Tensor], block: tuple[int, int], dtype: torch.dtype
                ) -> dict[str, torch.Tensor]:
    """Tensors with each fp8 weight dequantized (checked by :func:`fp8_specs` first) and the scales dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(FP8_SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8(t, tensors[name + FP8_SCALE_SUFFIX], block, dtype)
        else:
            out[name] = t
    return out
