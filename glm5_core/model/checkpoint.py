"""HF ``glm_moe_dsa`` checkpoint directories: config.json + sharded safetensors + model.safetensors.index.json.

Files on disk are untrusted: only JSON and safetensors are read (never pickle); the loader checks the
config values (GLM5Config.from_hf_dict), that the index is a {name: shard file} map over plain file names in
the directory, that each shard holds exactly the names the index gives it, and that every tensor the model
expects is present once with the expected shape and dtype. Unknown tensor names are rejected. All of this
is checked from the shards' headers before any tensor data is read or any parameter is allocated.
Writes are atomic per file (temporary file, then rename).

transformers interop (see ``hf_layout``): every directory transformers' ``GlmMoeDsaForCausalLM.save_pretrained``
writes loads (fused or per-expert experts, fp32 router weights in a bf16 checkpoint, and an MTP module the
config declares but the shards lack: transformers stores none, so the main model loads and one line says
so), and ``save_pretrained`` writes a directory transformers loads and computes the same logits from.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Optional, Union

import torch

from glm5_core.model import hf_layout
from glm5_core.model.config import NEXT_MODEL_TYPE, NEXT_TEXT_MODEL_TYPE, GLM5Config
from glm5_core.model.modeling import GLM5ForCausalLM
from glm5_core.model.rope import RotaryEmbedding
from glm5_core.safe_files import check_finite, checkpoint_root, open_safetensors, read_json

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_JSON_BYTES = 64 * 1024 * 1024
DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
_SHARD_RE = re.compile(r"^[A-Za-z0-9_.\-]+\.safetensors$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d{1,9})\.")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d{1,9})\.mlp\.experts\.(\d{1,9})\.")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
FP8_DTYPES = dict(SAFETENSORS_DTYPES, F8_E4M3=torch.float8_e4m3fn)  # a checkpoint with an fp8 quantization_config
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}

_LOG = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
TensorSpec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) from a safetensors header


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str, what: str) -> dict:
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{what}: {path} does not exist")
    value = read_json(path, root=checkpoint_root(os.path.dirname(path)), max_bytes=MAX_JSON_BYTES)
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected a JSON object in {path}, got {type(value).__name__}")
    return value


def checkpoint_state(model: GLM5ForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores, by HF name (a tied lm_head is stored once, as the embedding)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_pretrained(model: GLM5ForCausalLM, path: PathLike, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    transformers_form: bool = True) -> list[str]:
    """Write ``path/config.json``, ``model-0000i-of-0000n.safetensors`` shards and the index; return shard names.

    The directory is in transformers' form (``hf_layout.to_transformers_form``): a model whose latent norms use
    another epsilon than transformers' 1e-6 (the ``tiny`` preset) or that rotates RoPE halves is written with
    its projections rescaled / permuted so transformers computes the same function; such a model reads back
    as an equal function, not bit for bit. With ``transformers_form=False`` the weights and config are written
    as they are (``load_pretrained`` reads them back bitwise: what an RL weight sync to glm5-core engines needs).
    The MTP module is layer ``num_hidden_layers`` (DeepSeek-V3 style)."""
    from safetensors.torch import save

    if not isinstance(model, GLM5ForCausalLM):
        raise TypeError(f"model: expected a GLM5ForCausalLM, got {type(model).__name__}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: expected an int >= 1, got {max_shard_bytes!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in checkpoint_state(model).items()}
    if model.config.is_hybrid:  # transformers' Glm5NextForConditionalGeneration names (the language model)
        cfg, state = model.config, hf_layout.to_next_names(state)
    elif transformers_form:  # what transformers computes with
        cfg, state = hf_layout.to_transformers_form(model.config, state)
    else:
        cfg = model.config

    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, t in state.items():  # module order; a tensor larger than the limit gets a shard of its own
        nbytes = t.numel() * t.element_size()
        if groups[-1] and group_bytes + nbytes > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += nbytes
    n = len(groups)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    for file, names in zip(files, groups):
        _atomic_write_bytes(os.path.join(path, file), save({k: state[k] for k in names}, metadata={"format": "pt"}))
        weight_map.update({k: file for k in names})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _atomic_write_bytes(os.path.join(path, INDEX_NAME), json.dumps(index, indent=2).encode())
    config = cfg.to_hf_dict()
    if cfg.is_hybrid and "vision_config" not in config:  # transformers builds a vision tower from it: a small
        config["vision_config"] = dict(NEXT_PLACEHOLDER_VISION)  # one (its weights are not in this checkpoint)
    dtype = _DTYPE_NAMES.get(model.lm_head.weight.dtype, str(model.lm_head.weight.dtype))
    config["torch_dtype"] = config["dtype"] = dtype  # transformers 5 reads "dtype" first
    _atomic_write_bytes(os.path.join(path, CONFIG_NAME), json.dumps(config, indent=2).encode())
    return files


# the vision_config save_pretrained writes for a glm5_next model that came with none: one small block, so that
# transformers (which builds Glm5NextForConditionalGeneration's vision tower from it) does not build GLM-5.3's
NEXT_PLACEHOLDER_VISION = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16,
                           "out_hidden_size": 16, "projection_intermediate_size": 16}


def load_hf_config(path: PathLike) -> GLM5Config:
    """The GLM5Config of a ``save_pretrained`` directory (its HF ``config.json``)."""
    return GLM5Config.from_hf_dict(_read_config(os.fspath(path)))


def _read_config(path: str) -> dict:
    return _read_json(os.path.join(path, CONFIG_NAME), "config.json")


def _is_next(raw: dict) -> bool:
    return raw.get("model_type") in (NEXT_MODEL_TYPE, NEXT_TEXT_MODEL_TYPE)


def _text_part(raw: dict) -> dict:
    """The dict holding the text model's keys (glm5_next nests them in text_config)."""
    if _is_next(raw) and isinstance(raw.get("text_config"), dict):
        return raw["text_config"]
    return raw


def _with_mtp_layers(raw: dict, n: int) -> dict:
    if _text_part(raw) is raw:
        return dict(raw, num_nextn_predict_layers=n)
    return dict(raw, text_config=dict(raw["text_config"], num_nextn_predict_layers=n))


def _config_for_shards(raw: dict, names: Iterable[str]) -> tuple[GLM5Config, Optional[str]]:
    """The config to build, and why there is no MTP module when config.json declares one the shards lack
    (transformers runs no MTP and writes none: its checkpoints of GLM-5's config all declare one)."""
    main = GLM5Config.from_hf_dict(_with_mtp_layers(raw, 0))  # every other value checked here
    mtp_prefix = f"model.layers.{main.num_hidden_layers}."
    if any(name.startswith(mtp_prefix) for name in names):
        return GLM5Config.from_hf_dict(raw), None
    declared = _text_part(raw).get("num_nextn_predict_layers", 0 if _is_next(raw) else
                                   GLM5Config.num_nextn_predict_layers)
    if isinstance(declared, bool) or not isinstance(declared, int) or not 0 <= declared <= main.num_hidden_layers:
        raise ValueError(f"num_nextn_predict_layers: expected an integer in [0, {main.num_hidden_layers}], "
                         f"got {declared!r:.40}")
    if not declared:
        return main, None
    reason = (f"config.json declares num_nextn_predict_layers={declared} but the shards hold no "
              f"{mtp_prefix}* weights (transformers writes none): the MTP module is absent")
    return main, reason


def _weight_map(path: str) -> dict[str, str]:
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.exists(index_path):
        if os.path.isfile(os.path.join(path, SINGLE_NAME)):
            return {}  # single-file checkpoint: names come from the file
        raise FileNotFoundError(f"checkpoint: neither {INDEX_NAME} nor {SINGLE_NAME} in {path}")
    index = _read_json(index_path, INDEX_NAME)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{INDEX_NAME}: expected a non-empty object 'weight_map' {{tensor name: shard file}}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _SHARD_RE.match(file) or file in (".", ".."):
            raise ValueError(f"{INDEX_NAME}: weight_map[{name!r}]: expected a plain *.safetensors file name, "
                             f"got {file!r}")
    return weight_map


def _shard_files(path: str, weight_map: dict[str, str]) -> list[str]:
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
    for file in files:
        if not os.path.lexists(os.path.join(path, file)):
            raise FileNotFoundError(f"{INDEX_NAME}: shard {file} is listed but missing from {path}")
    return files


def header_specs(handle, file: str, dtypes: Optional[dict[str, torch.dtype]] = None) -> dict[str, TensorSpec]:
    """{name: (shape, dtype)} of an open ``safetensors.safe_open`` handle, from its header only."""
    dtypes = SAFETENSORS_DTYPES if dtypes is None else dtypes
    specs: dict[str, TensorSpec] = {}
    for name in sorted(handle.keys()):
        tensor_slice = handle.get_slice(name)
        dtype_name = tensor_slice.get_dtype()
        if dtype_name not in dtypes:
            raise ValueError(f"{file}: {name}: expected one of the dtypes {sorted(dtypes)}, "
                             f"got {dtype_name!r}")
        specs[name] = (tuple(tensor_slice.get_shape()), dtypes[dtype_name])
    return specs


def _read_headers(path: str, weight_map: dict[str, str], fp8: bool = False) -> dict[str, TensorSpec]:
    """Every tensor's (shape, dtype) from the shards' headers, reading no tensor data."""
    specs: dict[str, TensorSpec] = {}
    for file in _shard_files(path, weight_map):
        with open_safetensors(os.path.join(path, file), root=checkpoint_root(path)) as f:
            names = set(f.keys())
            if weight_map:
                listed = {k for k, v in weight_map.items() if v == file}
                if names != listed:
                    extra, missing = sorted(names - listed), sorted(listed - names)
                    raise ValueError(f"{file}: contents disagree with {INDEX_NAME}: in the file but not the index "
                                     f"{extra[:5]}, in the index but not the file {missing[:5]}")
            for name, spec in header_specs(f, file, FP8_DTYPES if fp8 else None).items():
                if name in specs:
                    raise ValueError(f"{file}: tensor {name!r} appears in more than one shard")
                specs[name] = spec
    return specs


def _indices(names: Iterable[str], pattern: re.Pattern[str]) -> dict[int, set[int]]:
    """{first captured index: set of second captured indices (empty when the pattern has one group)}."""
    out: dict[int, set[int]] = {}
    for name in names:
        match = pattern.match(name)
        if match:
            out.setdefault(int(match.group(1)), set()).update(int(g) for g in match.groups()[1:])
    return out


def _check_layout(cfg: GLM5Config, names: Iterable[str]) -> None:
    """Layer and expert counts of the config against the names in the shards, before any module is built
    (a config with 10**6 layers or experts would otherwise cost gigabytes of modules, even on ``meta``)."""
    names = list(names)
    n_layers = cfg.num_hidden_layers + (1 if cfg.num_nextn_predict_layers else 0)
    layers = set(_indices(names, _LAYER_RE))
    if layers != set(range(n_layers)):
        shown = sorted(layers)
        mtp = " + the MTP layer" if cfg.num_nextn_predict_layers else ""
        raise ValueError(f"checkpoint: config.json implies layers 0..{n_layers - 1} (num_hidden_layers="
                         f"{cfg.num_hidden_layers}{mtp}), "
                         f"the shards hold {len(shown)} layers {shown[:5]}{' ...' if len(shown) > 5 else ''}")
    experts = _indices(names, _EXPERT_RE)
    for layer in range(cfg.first_k_dense_replace, n_layers):
        got = experts.get(layer, set())
        if got != set(range(cfg.n_routed_experts)):
            raise ValueError(f"checkpoint: config.json implies n_routed_experts={cfg.n_routed_experts} in layer "
                             f"{layer}, the shards hold {len(got)} experts there")


def _check_tensors(specs: dict[str, TensorSpec], expected: dict[str, torch.Tensor]) -> None:
    """Names, shapes and dtypes; a tensor transformers keeps in fp32 (hf_layout.keeps_fp32) may be fp32."""
    unknown = sorted(set(specs) - set(expected))
    missing = sorted(set(expected) - set(specs))
    if unknown or missing:
        raise ValueError(f"checkpoint: tensor names do not match the config: unknown {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}, missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    for name, want in expected.items():
        shape, dtype = specs[name]
        if shape != tuple(want.shape):
            raise ValueError(f"checkpoint: {name}: expected shape {tuple(want.shape)} (from config.json), got {shape}")
        if dtype != want.dtype and not (dtype == torch.float32 and hf_layout.keeps_fp32(name)):
            raise ValueError(f"checkpoint: {name}: expected dtype {want.dtype}, got {dtype}")


def _read_tensors(path: str, weight_map: dict[str, str], skip=None) -> dict[str, torch.Tensor]:
    """Every tensor's data (but those ``skip(name)`` is true of); NaN / Inf weights are refused here, naming
    the tensor."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _shard_files(path, weight_map):
        with open_safetensors(os.path.join(path, file), root=checkpoint_root(path)) as f:
            for name in f.keys():
                if skip is not None and skip(name):
                    continue
                tensors[name] = f.get_tensor(name)
                check_finite(name, tensors[name], f"checkpoint: {file}")
    return tensors


RUN_EXPORT_DIR = "final"  # where glm5 pretrain writes a run's weights in this layout (its trainer's EXPORT_DIR)


def check_checkpoint_dir(path: PathLike, what: str) -> str:
    """``path`` as a string when it is a directory holding ``config.json``; else FileNotFoundError naming
    ``what`` (an argument or flag), suggesting ``<path>/final`` when ``path`` is a pretraining run folder."""
    path = os.fspath(path)
    expected = f"{what}: expected a checkpoint directory (config.json + safetensors, as save_pretrained writes)"
    if not os.path.isdir(path):
        state = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise FileNotFoundError(f"{expected}, got {path!r}, which {state}")
    if not os.path.lexists(os.path.join(path, CONFIG_NAME)):
        final = os.path.join(path, RUN_EXPORT_DIR)
        hint = (f"; it looks like a pretraining run folder: did you mean {final!r}?"
                if os.path.isfile(os.path.join(final, CONFIG_NAME)) else "")
        raise FileNotFoundError(f"{expected}, got {path!r}, which has no {CONFIG_NAME}{hint}")
    return path


def load_pretrained(path: PathLike, backend: Optional[str] = None) -> GLM5ForCausalLM:
    """Build a GLM5ForCausalLM from a checkpoint directory, in the checkpoint's dtype; eval mode not set.

    Order: config values, index, shard headers (names, shapes, dtypes) against a ``meta``-device model of
    the config; only then is tensor data read, once, and assigned to the model (nothing is allocated twice
    and nothing is sized by config.json alone)."""
    path = check_checkpoint_dir(path, "path")
    raw = _read_config(path)
    block = hf_layout.fp8_block_size(raw.get("quantization_config"))  # ValueError naming any other method
    raw = {key: value for key, value in raw.items() if key != "quantization_config"}
    next_layout = _is_next(raw)
    weight_map = _weight_map(path)
    specs = _read_headers(path, weight_map, fp8=block is not None)
    skipped = 0
    if next_layout:
        specs, skipped = hf_layout.next_entries(specs)
    embed = specs.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError("checkpoint: missing model.embed_tokens.weight")
    if not embed[1].is_floating_point or embed[1] == torch.float8_e4m3fn:
        raise ValueError(f"checkpoint: model.embed_tokens.weight: expected a floating dtype, got {embed[1]}")
    if block is not None:
        specs = hf_layout.fp8_specs(specs, block, embed[1])
    specs = hf_layout.drop_empty(hf_layout.split_fused_specs(specs))
    cfg, mtp_absent = _config_for_shards(raw, specs)
    _check_layout(cfg, specs)
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg, backend=backend)
    model.to(embed[1])  # the router's selection bias stays fp32 (Gate._apply)
    _check_tensors(specs, checkpoint_state(model))

    if next_layout:
        tensors, _ = hf_layout.next_entries(_read_tensors(path, weight_map, skip=lambda name: hf_layout.next_name(
            name) is None))
    else:
        tensors = _read_tensors(path, weight_map)
    if block is not None:
        tensors = hf_layout.fp8_tensors(tensors, block, embed[1])
    tensors = hf_layout.drop_empty(hf_layout.split_fused_tensors(tensors))
    missing, unexpected = model.load_state_dict(tensors, strict=not cfg.tie_word_embeddings, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True replaced the shared Parameter
    # inv_freq is not stored: rebuild it and cast it as model.to(dtype) casts a model built on a device
    model.model.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta).to(embed[1])
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not on_meta, f"not materialised by the checkpoint: {on_meta[:5]}"
    if skipped:
        _LOG.warning("checkpoint: skipped %d vision-tower tensors (glm5-core loads the language model of a "
                     "Glm5NextForConditionalGeneration checkpoint only)", skipped)
    if mtp_absent:
        model.mtp_absent_reason = mtp_absent
        _LOG.warning("%s; loaded the main model only (%s)", mtp_absent, path)
    return model
