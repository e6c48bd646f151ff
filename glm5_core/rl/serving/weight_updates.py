"""Server side of SGLang's weight-update routes: version labels, weights from disk, weights over a group.

* :class:`VersionLabels`: SGLang's ``weight_version`` is any string (``"default"`` until the first update);
  the engine counts versions as ints (tokens record them, the prefix cache compares them). A decimal label is
  its own int; any other label gets the next int after the newest.
* :func:`load_disk_weights`: ``model_path`` of ``/update_weights_from_disk``: an HF-format ``glm_moe_dsa``
  directory (``save_pretrained``; read by ``load_pretrained``, which checks every header before reading data),
  or a ``.safetensors`` file directly inside the server's weights directory (the file glm5 rl writes for the
  engines it spawns). With a weights directory, directories outside it are refused too.
* :class:`DistributedReceiver`: ``/init_weights_update_group`` joins a
  :class:`~glm5_core.rl.serving.weight_group.WeightUpdateGroup`; ``/update_weights_from_distributed`` receives
  one bucket of named tensors over it, each checked against the engine's own name, shape and dtype first (so
  nothing is allocated that the request sized).
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from glm5_core.rl.serving.weight_group import DEFAULT_TIMEOUT_S, WeightUpdateGroup

DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32")}


class VersionLabels:
    """Engine version (int) <-> the label a server reports; thread-safe."""

    def __init__(self, version: int, label: Optional[str] = None):
        self._lock = threading.Lock()
        self._labels: dict[int, str] = {int(version): str(version) if label is None else label}

    def label(self, version: int) -> str:
        with self._lock:
            return self._labels.get(int(version), str(version))

    def engine_version(self, label, newest: int) -> int:
        """The engine version for ``label`` (a str or int, as a client sent it; None: the next version)."""
        if label is None:
            return newest + 1
        if isinstance(label, bool) or not isinstance(label, (str, int)) or (isinstance(label, str) and not label):
            raise ValueError(f"weight_version: expected a non-empty str, got {label!r:.80}")
        text = str(label)
        if len(text) > 256:
            raise ValueError(f"weight_version: expected at most 256 characters, got {len(text)}")
        if text.isdigit() and len(text) < 19:
            return int(text)
        return newest + 1

    def remember(self, version: int, label) -> None:
        with self._lock:
            self._labels[int(version)] = str(version) if label is None else str(label)


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def load_disk_weights(model_path, weights_dir: Optional[str]) -> dict[str, torch.Tensor]:
    """The state dict ``model_path`` names (see the module docstring); ``ValueError`` naming ``model_path``."""
    if not isinstance(model_path, str) or not model_path:
        raise ValueError(f"model_path: expected a path, got {model_path!r:.80}")
    real = os.path.realpath(model_path)
    if weights_dir is not None and not _inside(real, weights_dir):
        raise ValueError(f"model_path: expected a path inside {weights_dir}, got {model_path!r}")
    if os.path.isdir(real):
        from glm5_core.model import load_pretrained

        try:
            model = load_pretrained(real)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"model_path: cannot load {model_path!r} ({type(exc).__name__}: {exc})") from None
        return {k: v.detach() for k, v in model.state_dict().items()}
    if weights_dir is None or os.path.dirname(real) != weights_dir or not real.endswith(".safetensors"):
        raise ValueError(f"model_path: expected a model directory (save_pretrained), or a .safetensors file "
                         f"directly inside the weights directory, got {model_path!r}")
    if not os.path.isfile(real):
        raise ValueError(f"model_path: no such file {model_path!r}")
    from safetensors.torch import load_file

    try:
        return load_file(real)
    except Exception as exc:  # truncated / not safetensors: the caller's file is bad, the engine is fine
        raise ValueError(f"model_path: cannot read {model_path!r} as safetensors "
                         f"({type(exc).__name__}: {exc})") from None


class DistributedReceiver:
    """The weight-update groups this server joined, by name. One operation at a time."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._lock = threading.Lock()
        self._timeout_s = timeout_s

    def init_group(self, body: dict) -> None:
        known = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"request: unknown fields {unknown}")
        name = body.get("group_name", "weight_update_group")
        with self._lock:
            if name in self._groups:
                self._groups.pop(name).close()
            try:
                self._groups[name] = WeightUpdateGroup(
                    master_address=body.get("master_address"), master_port=body.get("master_port"),
                    rank=body.get("rank_offset"), world_size=body.get("world_size"), group_name=name,
                    backend=body.get("backend", "nccl"), timeout_s=self._timeout_s)
            except (RuntimeError, OSError) as exc:  # rendezvous failed: the caller's group, not the engine
                raise ValueError(f"init_weights_update_group: {type(exc).__name__}: {exc}") from None

    def receive(self, body: dict, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) \
                or not len(names) == len(dtypes) == len(shapes) or not names:
            raise ValueError("names / dtypes / shapes: expected three lists of one equal, non-zero length")
        if body.get("load_format") not in (None, "auto"):
            raise ValueError(f"load_format: expected null, got {body.get('load_format')!r:.80}")
        torch_dtypes: list[torch.dtype] = []
        for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
            if not isinstance(name, str) or name not in expected:
                raise ValueError(f"names[{i}]: expected a weight name of this model, got {name!r:.80}")
            if dtype not in DTYPES or DTYPES[dtype] != expected[name].dtype:
                raise ValueError(f"dtypes[{i}]: expected {str(expected[name].dtype).replace('torch.', '')} "
                                 f"for {name}, got {dtype!r:.80}")
            if shape != list(expected[name].shape):
                raise ValueError(f"shapes[{i}]: expected {list(expected[name].shape)} for {name}, got {shape!r:.80}")
            torch_dtypes.append(DTYPES[dtype])
        if len(set(names)) != len(names):
            raise ValueError("names: expected each weight once per bucket")
        group_name = body.get("group_name", "weight_update_group")
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                raise ValueError(f"group_name: no group {group_name!r:.80}; call /init_weights_update_group first")
            device = next(iter(expected.values())).device
            try:
                tensors = group.receive(shapes, torch_dtypes, device)
            except RuntimeError as exc:  # a peer died or timed out: this group is unusable now
                self._groups.pop(group_name).close()
                raise ValueError(f"update_weights_from_distributed: group {group_name!r} failed "
                                 f"({type(exc).__name__}: {exc}); form it again") from None
        return dict(zip(names, tensors))

    def destroy(self, name: str) -> bool:
        with self._lock:
            group = self._groups.pop(name, None)
        if group is not None:
            group.close()
        return group is not None

    def close(self) -> None:
        for name in list(self._groups):
            self.destroy(name)
