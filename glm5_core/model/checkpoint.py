"""HF ``glm_moe_dsa`` checkpoint directories: config.json + sharded safetensors + model.safetensors.index.json.

Files on disk are untrusted: only JSON and safetensors are read (never pickle); the loader checks the
config values (GLM5Config.from_hf_dict), that the index is a {name: shard file} map over plain file names in
the directory, that each shard holds exactly the names the index gives it, and that every tensor the model
expects is present once with the expected shape and dtype. Unknown tensor names are rejected.
Writes are atomic per file (temporary file, then rename).
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Union

import torch

from glm5_core.model.config import GLM5Config
from glm5_core.model.modeling import GLM5ForCausalLM

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_JSON_BYTES = 64 * 1024 * 1024
DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
_SHARD_RE = re.compile(r"^[A-Za-z0-9_.\-]+\.safetensors$")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}

PathLike = Union[str, os.PathLike]


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: {path} does not exist")
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{what}: expected a JSON file under {MAX_JSON_BYTES} bytes, got {size} bytes ({path})")
    with open(path, "r", encoding="utf-8") as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what}: {path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected a JSON object in {path}, got {type(value).__name__}")
    return value


def checkpoint_state(model: GLM5ForCausalLM) -> Dict[str, torch.Tensor]:
    """The tensors a checkpoint stores, by HF name (a tied lm_head is stored once, as the embedding)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_pretrained(model: GLM5ForCausalLM, path: PathLike, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> List[str]:
    """Write ``path/config.json``, ``model-0000i-of-0000n.safetensors`` shards and the index; return shard names."""
    from safetensors.torch import save

    if not isinstance(model, GLM5ForCausalLM):
        raise TypeError(f"model: expected a GLM5ForCausalLM, got {type(model).__name__}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: expected an int >= 1, got {max_shard_bytes!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in checkpoint_state(model).items()}

    groups: List[List[str]] = [[]]
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
    weight_map: Dict[str, str] = {}
    for file, names in zip(files, groups):
        _atomic_write_bytes(os.path.join(path, file), save({k: state[k] for k in names}, metadata={"format": "pt"}))
        weight_map.update({k: file for k in names})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _atomic_write_bytes(os.path.join(path, INDEX_NAME), json.dumps(index, indent=2).encode())
    config = model.config.to_hf_dict()
    config["torch_dtype"] = _DTYPE_NAMES.get(model.lm_head.weight.dtype, str(model.lm_head.weight.dtype))
    _atomic_write_bytes(os.path.join(path, CONFIG_NAME), json.dumps(config, indent=2).encode())
    return files


def load_config(path: PathLike) -> GLM5Config:
    return GLM5Config.from_hf_dict(_read_json(os.path.join(os.fspath(path), CONFIG_NAME), "config.json"))


def _weight_map(path: str) -> Dict[str, str]:
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
            raise ValueError(f"{INDEX_NAME}: weight_map[{name!r}]: expected a plain *.safetensors file name, got {file!r}")
    return weight_map


def _read_tensors(path: str, weight_map: Dict[str, str]) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
    tensors: Dict[str, torch.Tensor] = {}
    for file in files:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"{INDEX_NAME}: shard {file} is listed but missing from {path}")
        try:
            with safe_open(full, framework="pt", device="cpu") as f:
                names = set(f.keys())
                if weight_map:
                    listed = {k for k, v in weight_map.items() if v == file}
                    if names != listed:
                        extra, missing = sorted(names - listed), sorted(listed - names)
                        raise ValueError(f"{file}: contents disagree with {INDEX_NAME}: in the file but not the index "
                                         f"{extra[:5]}, in the index but not the file {missing[:5]}")
                for name in names:
                    if name in tensors:
                        raise ValueError(f"{file}: tensor {name!r} appears in more than one shard")
                    tensors[name] = f.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"{file}: not a valid safetensors file ({exc})") from None
    return tensors


def _check_tensors(tensors: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise ValueError(f"checkpoint: tensor names do not match the config: unknown {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}, missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"checkpoint: {name}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
        if got.dtype != want.dtype:
            raise ValueError(f"checkpoint: {name}: expected dtype {want.dtype}, got {got.dtype}")


def load_pretrained(path: PathLike, backend: Optional[str] = None) -> GLM5ForCausalLM:
    """Build a GLM5ForCausalLM from a checkpoint directory, in the checkpoint's dtype; eval mode not set."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"path: expected a checkpoint directory, got {path!r}")
    cfg = load_config(path)
    weight_map = _weight_map(path)
    tensors = _read_tensors(path, weight_map)
    model = GLM5ForCausalLM(cfg, backend=backend)
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError("checkpoint: missing model.embed_tokens.weight")
    if not embed.dtype.is_floating_point:
        raise ValueError(f"checkpoint: model.embed_tokens.weight: expected a floating dtype, got {embed.dtype}")
    model.to(embed.dtype)  # the router's selection bias stays fp32 (Gate._apply)
    expected = checkpoint_state(model)
    _check_tensors(tensors, expected)
    missing, unexpected = model.load_state_dict(tensors, strict=not cfg.tie_word_embeddings)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model
