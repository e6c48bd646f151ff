"""Training checkpoints: safetensors + JSON only (never pickle), written atomically.

Layout of ``<output_dir>/checkpoints/step_00000042/``:
  model.safetensors       the model's state_dict (parameters and buffers, e.g. the router biases)
  optimizer.safetensors   every optimizer state tensor as ``<part>/<param index>/<key>``; the param groups'
                          hyper-parameters as JSON in the file's metadata
  rng.safetensors         torch CPU (and accelerator) RNG states as uint8 tensors
  trainer_state.json      step, data position, Python RNG state, world size, format version
A checkpoint is written into a temporary folder, every file fsynced, then renamed into place; ``latest``
(the run's checkpoints, newest first, one name a line) is replaced atomically afterwards. Which folders are
kept, how a re-written step is replaced and what a killed writer leaves: ``checkpoint_folders.py``.

Every file is read as untrusted (``glm5_core.safe_files``): regular files inside the checkpoint folder,
size-capped JSON of bounded depth, safetensors headers checked against the model before any tensor is read,
loaded weights and optimizer state finite; anything else is a ValueError naming the file and tensor or key.

Tensors are always whole: a sharded (FSDP2) run gathers every DTensor (all ranks take part) and rank 0
writes the very files a DDP or single-process run writes. Tied weights (``tie_word_embeddings``) are stored
once, under the sorted-first name of their group (:func:`glm5_core.train.fsdp.stored_name`), whatever the
strategy; loading fills every name of a group from it. Loading cuts each whole tensor back to this
rank's shard, so a checkpoint resumes under either strategy and any world size that divides the batch
(bitwise repetition of the uninterrupted run needs the same world size and strategy).
"""
from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import save_file

from glm5_core.device_facts import torch_device_module
from glm5_core.model.checkpoint import header_specs
from glm5_core.optim.muon import Muon
from glm5_core.safe_files import check_finite, open_safetensors, parse_json, read_json
from glm5_core.train import checkpoint_folders as folders
from glm5_core.train.checkpoint_folders import LATEST, MAX_STATE_BYTES, resolve_checkpoint  # noqa: F401
from glm5_core.train.fsdp import full_state_dict, full_tensor, is_dtensor, local_part, stored_name, tied_groups

FORMAT_VERSION = 1
MAX_RNG_BYTES = 16 * 1024 * 1024  # rng.safetensors: a few KB per device
TensorSpec = tuple[tuple[int, ...], torch.dtype]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True), encoding="utf-8")


# ---------------------------------------------------------------------------------- optimizer state


def _flatten_optimizer(state: dict[str, dict], keep: bool = True):
    """Optimizer state as flat whole tensors + JSON metadata. A collective when the state holds DTensors
    (every rank calls it; ``keep=False`` gathers and drops, for the ranks that do not write)."""
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, Any] = {}
    for part, sd in state.items():
        groups[part] = sd["param_groups"]
        for pid, entries in sd["state"].items():
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value)
                whole = full_tensor(value.detach())
                if keep:
                    tensors[f"{part}/{pid}/{key}"] = whole.contiguous().cpu()
    return tensors, {"param_groups": json.dumps(groups)}


# Group keys that tie a saved group to this optimizer's group (ids, schedule role, Muon Split); they must be equal.
_GROUP_IDENTITY = ("params", "name", "role", "optimizer", "split_heads", "split_dim")


def _json_kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _check_groups(part: str, got: Any, want: list[dict]) -> None:
    """Saved param groups (JSON) against this optimizer's: same ids and identity, same kinds of values."""
    if not isinstance(got, list) or len(got) != len(want) or not all(isinstance(g, dict) for g in got):
        sizes = [len(g.get("params", ())) for g in got if isinstance(g, dict)] if isinstance(got, list) else got
        raise ValueError(f"checkpoint: optimizer part {part!r} has param groups of sizes {sizes}, this model needs "
                         f"{[len(g['params']) for g in want]} (was the model or optimizer config changed?)")
    for i, (saved, current) in enumerate(zip(got, want)):
        if set(saved) != set(current):
            raise ValueError(f"checkpoint: optimizer part {part!r} group {i}: expected keys {sorted(current)}, "
                             f"got {sorted(saved)}")
        for key, expected in current.items():
            value = saved[key]
            if key in _GROUP_IDENTITY:
                if value != (list(expected) if isinstance(expected, tuple) else expected):
                    raise ValueError(f"checkpoint: optimizer part {part!r} group {i} {key}: expected {expected!r}, "
                                     f"got {value!r} (was the model or optimizer config changed?)")
            elif _json_kind(value) != _json_kind(expected) or (
                    _json_kind(value) == "number" and not math.isfinite(value)):
                raise ValueError(f"checkpoint: optimizer part {part!r} group {i} {key}: expected a finite "
                                 f"{_json_kind(expected)} like {expected!r}, got {value!r}")


def _check_adamw_hyper(group: dict) -> None:
    """The ranges ``torch.optim.AdamW``'s constructor enforces (kinds and finiteness are checked already)."""
    for key in ("lr", "eps", "weight_decay"):
        if group[key] < 0:
            raise ValueError(f"{key}: expected a number >= 0, got {group[key]!r}")
    betas = group["betas"]
    if len(betas) != 2 or not all(_json_kind(b) == "number" and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas: expected two numbers in [0, 1), got {betas!r}")


def _check_hyper(part: str, saved_groups: list[dict], opt: torch.optim.Optimizer) -> None:
    """The saved hyper-parameters, which ``load_state_dict`` puts in place of this run's, under the rules the
    optimizer's constructor applies: a crafted momentum of 1.5 or a negative weight decay is refused at load,
    not trained with."""
    for i, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        try:
            if isinstance(opt, Muon):
                Muon._check_group({**saved, "params": group["params"]})
            elif isinstance(opt, torch.optim.AdamW):
                _check_adamw_hyper(saved)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"checkpoint: optimizer part {part!r} group {i} {exc}") from None


def _state_keys(opt: torch.optim.Optimizer, group: dict) -> Optional[set]:
    """The state keys ``opt`` keeps per stepped parameter; None for an optimizer this module does not know."""
    if isinstance(opt, torch.optim.AdamW):
        return {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
    if isinstance(opt, Muon):
        return {"momentum_buffer"}
    return None


def _check_state(where: str, specs: dict[str, TensorSpec], param: torch.Tensor, keys: Optional[set]) -> None:
    """One parameter's saved state, from the file's header (before any of it is read): the keys its
    optimizer keeps, a scalar step, the rest shaped like the parameter."""
    if keys is not None and set(specs) != keys:
        raise ValueError(f"checkpoint: optimizer state of {where}: expected keys {sorted(keys)}, got {sorted(specs)}")
    for key, (shape, dtype) in specs.items():
        if key == "step":
            if shape != () or dtype == torch.bool:
                raise ValueError(f"checkpoint: optimizer state of {where} step: expected a finite scalar >= 0, got "
                                 f"{dtype} of shape {shape}")
        elif shape != tuple(param.shape) or dtype != param.dtype:
            raise ValueError(f"checkpoint: optimizer state of {where} {key}: expected {param.dtype} of shape "
                             f"{tuple(param.shape)}, got {dtype} of shape {shape}")


def _check_state_values(where: str, entries: dict[str, torch.Tensor], path: Path) -> None:
    """The values read: a step >= 0, every state tensor finite (a NaN moment would poison every later step)."""
    for key, value in entries.items():
        if key == "step":
            if not math.isfinite(float(value)) or float(value) < 0:
                raise ValueError(f"checkpoint: optimizer state of {where} step: expected a finite scalar >= 0, got "
                                 f"{value.dtype} of shape {tuple(value.shape)} = {float(value)}")
        else:
            check_finite(f"{where} {key}", value, f"checkpoint: {path.name}")


def _read_part(f, part: str, sd: dict, stored: dict[int, dict[str, str]], specs: dict[str, TensorSpec],
               want: list[dict], opt: torch.optim.Optimizer, param_names: dict[int, str], path: Path) -> None:
    """One optimizer part of an open ``optimizer.safetensors``: its groups, then each parameter's state from
    the header, then read (and cut to this rank's shard) into ``sd["state"]``."""
    if isinstance(opt, Muon) and isinstance(sd["param_groups"], list):  # an older Muon checkpoint: its values
        sd["param_groups"] = [{**dict(Muon.KEYS_SINCE), **g} if isinstance(g, dict) else g for g in sd["param_groups"]]
    _check_groups(part, sd["param_groups"], want)
    _check_hyper(part, sd["param_groups"], opt)
    by_id = {pid: (param, group) for g, group in zip(want, opt.param_groups)
             for pid, param in zip(g["params"], group["params"])}
    unknown = sorted(set(stored) - set(by_id))
    if unknown:
        raise ValueError(f"checkpoint: optimizer part {part!r} has state for parameter {unknown[0]}, "
                         f"this model has {len(by_id)}")
    for pid, names in stored.items():
        param, group = by_id[pid]
        where = f"{param_names.get(id(param), f'parameter {pid}')} ({part})"
        _check_state(where, {key: specs[name] for key, name in names.items()}, param, _state_keys(opt, group))
        entries = {key: f.get_tensor(name) for key, name in names.items()}
        _check_state_values(where, entries, path)
        if is_dtensor(param):  # this rank's shard of each whole state tensor, laid out as the parameter
            entries = {k: v if k == "step" else local_part(v, param) for k, v in entries.items()}
        sd["state"][pid] = entries


def _unflatten_optimizer(path: Path, optimizer, param_names: dict[int, str]) -> dict[str, dict]:
    """Read and validate ``optimizer.safetensors`` against ``optimizer`` (a HybridOptimizer) before any of it is
    loaded: group ids and identity, state keys, and each state tensor's shape and dtype against its parameter.

    Tensors are read one parameter at a time and, for a sharded (DTensor) parameter, cut to this rank's shard
    at once: a rank never holds more than one parameter's whole state (reading all of it first held the
    whole optimizer state on every rank of a node at the same time)."""
    expected = optimizer.state_dict()
    with open_safetensors(path, root=path.parent) as f:
        meta = f.metadata()
        if not isinstance(meta.get("param_groups"), str):
            raise ValueError(f"checkpoint: {path} lacks valid param_groups metadata")
        groups = parse_json(meta["param_groups"], f"checkpoint: {path} metadata param_groups")
        if not isinstance(groups, dict):
            raise ValueError(f"checkpoint: {path} param_groups metadata: expected an object, "
                             f"got {type(groups).__name__}")
        out = {part: {"state": {}, "param_groups": groups.get(part)} for part in expected}
        stored: dict[str, dict[int, dict[str, str]]] = {part: {} for part in expected}  # part -> pid -> key -> name
        specs = header_specs(f, path.name)
        for name in specs:
            part, pid, key = (name.split("/") + ["", ""])[:3]
            if part not in out or not pid.isdigit() or len(pid) > 9 or not key:
                raise ValueError(f"checkpoint: unexpected optimizer tensor {name!r} in {path}")
            stored[part].setdefault(int(pid), {})[key] = name
        for part, sd in out.items():
            try:
                _read_part(f, part, sd, stored[part], specs, expected[part]["param_groups"],
                           optimizer.optimizers[part], param_names, path)
            except ValueError as exc:  # the checks name the part, parameter and key; add the file
                raise ValueError(str(exc) if path.name in str(exc) else f"{exc} in {path}") from None
    return out


def check_model_file(path: Path, model: torch.nn.Module, root: Optional[Path] = None) -> None:
    """ValueError unless ``model.safetensors``'s header (names, shapes, dtypes) fits ``model`` (a ``meta`` model
    will do): reads no tensor data. ``root``: the folder the file must stay inside (default its own)."""
    _check_model_file(Path(path), model, Path(path).parent if root is None else Path(root))


def _check_model_file(path: Path, model: torch.nn.Module, root: Path) -> None:
    """Names, shapes and dtypes in ``model.safetensors``'s header against ``model``, before reading its data."""
    expected = model.state_dict()
    with open_safetensors(path, root=root) as f:
        specs = header_specs(f, path.name)
    unexpected = sorted(set(specs) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint: model tensors do not match this model (unexpected {unexpected[:3]}) in {path}")
    for name, (shape, dtype) in specs.items():
        want = expected[name]
        if shape != tuple(want.shape) or dtype != want.dtype:
            raise ValueError(f"checkpoint: model tensors do not match this model ({name}: expected {want.dtype} of "
                             f"shape {tuple(want.shape)}, got {dtype} of shape {shape}) in {path}")


def _model_tensors_to_save(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The whole model tensors a checkpoint stores: one name per tied group (its :func:`stored_name`).
    A collective under FSDP2 (see :func:`full_state_dict`); empty with ``keep=False``."""
    state = full_state_dict(model, keep=keep)
    for group in tied_groups(model):
        for name in group:
            if name != stored_name(group):
                state.pop(name, None)
    return {name: t.contiguous() for name, t in state.items()}


@torch.no_grad()
def _load_model(model: torch.nn.Module, path: Path, root: Path) -> tuple[list[str], list[str]]:
    """Copy each whole tensor of ``path`` into the model: into this rank's shard for a DTensor, whole into a
    plain tensor. A tied group is filled from whichever of its names the file holds (one, as saved; several
    only if they are equal). Returns (missing, unexpected) names; reads nothing when either is non-empty."""
    targets = model.state_dict(keep_vars=True)  # Parameters and buffers themselves: tied names share one
    groups: dict[int, list[str]] = {}
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    with open_safetensors(path, root=root) as f:
        names = set(f.keys())
        unexpected = sorted(names - set(targets))
        missing = sorted(stored_name(g) for g in groups.values() if names.isdisjoint(g))
        if missing or unexpected:
            return missing, unexpected
        for group in groups.values():
            present = sorted(names.intersection(group))
            whole = f.get_tensor(present[0])
            check_finite(present[0], whole, f"checkpoint: {path}")
            for other in present[1:]:
                if not torch.equal(f.get_tensor(other), whole):
                    raise ValueError(f"checkpoint: model tensors {present[0]!r} and {other!r} are tied in this "
                                     f"model but differ in {path.name}")
            target = targets[group[0]]
            if is_dtensor(target):
                target.to_local().copy_(local_part(whole, target).to_local())
            else:
                target.copy_(whole)
    return [], []


# ---------------------------------------------------------------------------------- RNG


def load_model_weights(model: torch.nn.Module, path: Path, *, checked: bool = False,
                       root: Optional[Path] = None) -> None:
    """Load a checkpoint's ``model.safetensors`` (untrusted: a regular file inside ``root``, default its folder;
    names, shapes and dtypes are checked against ``model`` before any data is read, every value read must be
    finite) into ``model``, plain or sharded, tied groups filled from one name. Raises ValueError naming what
    does not match."""
    path = Path(path)
    root = path.parent if root is None else Path(root)
    if not checked:
        _check_model_file(path, model, root)
    try:
        missing, unexpected = _load_model(model, path, root)
    except RuntimeError as exc:  # shape mismatches
        reason = str(exc).splitlines()[-1].strip()
        raise ValueError(f"checkpoint: model tensors do not match this model ({reason}) in {path}") from None
    if missing or unexpected:
        raise ValueError(f"checkpoint: model tensors do not match this model (missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}) in {path}")


def _device_rng_function(device_type: str, kind: str):
    """``kind`` "get": () -> [state per device]; "set": (states) -> None, of torch's module for ``device_type``
    (found as the plug-in registers it: ``device_facts.torch_device_module``), or None for cpu. A module with
    only the per-device ``get_rng_state(i)`` / ``set_rng_state(state, i)`` is used device by device. A device type
    whose RNG states torch cannot give or take is a ValueError: skipping them would silently break bitwise resume."""
    module = torch_device_module(device_type)
    if module is None:
        return None
    whole, single = f"{kind}_rng_state_all", f"{kind}_rng_state"
    if hasattr(module, whole):
        return getattr(module, whole)
    if hasattr(module, single) and hasattr(module, "device_count"):
        one = getattr(module, single)
        if kind == "get":
            return lambda: [one(i) for i in range(module.device_count())]
        return lambda states: [one(state, i) for i, state in enumerate(states)]
    raise ValueError(f"checkpoint: torch.{device_type} has no {whole} (nor {single} with device_count): its RNG "
                     f"states cannot be saved or restored, and a resume would not be bitwise; the vendor's torch "
                     f"plug-in must register them")


def _rng_tensors(device_type: str) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    get_all = _device_rng_function(device_type, "get")
    if get_all is not None:
        for i, state in enumerate(get_all()):
            out[f"{device_type}_{i}"] = state
    return out


def _device_rng_states(states: dict[str, torch.Tensor], device_type: str, device_count: int) -> list[torch.Tensor]:
    """The saved RNG states of devices 0, 1, ... (keys ``<device_type>_<index>``, ordered by the integer
    index: ``<device_type>_2`` before ``<device_type>_10``) that this node can take: the first
    ``min(saved, device_count)``. A checkpoint written on a node with more devices restores those and warns
    about the rest."""
    prefix = f"{device_type}_"
    by_index: dict[int, torch.Tensor] = {}
    for key, state in states.items():
        if not key.startswith(prefix):
            continue
        index = key[len(prefix):]
        if not index.isdigit() or len(index) > 6:
            raise ValueError(f"checkpoint: unexpected RNG state {key!r} (expected {prefix}<device index>)")
        by_index[int(index)] = state
    if sorted(by_index) != list(range(len(by_index))):
        raise ValueError(f"checkpoint: {device_type} RNG states of devices {sorted(by_index)[:8]}, expected "
                         f"devices 0..{len(by_index) - 1}")
    if len(by_index) > device_count:
        warnings.warn(f"checkpoint: holds RNG states of {len(by_index)} {device_type} devices, this node has "
                      f"{device_count}: restoring devices 0..{device_count - 1}, ignoring the rest", stacklevel=3)
    return [by_index[i] for i in range(min(len(by_index), device_count))]


def _restore_rng(path: Path, device_type: str) -> None:
    with open_safetensors(path, root=path.parent, max_bytes=MAX_RNG_BYTES) as f:  # tensors <= the file's size
        states = {k: f.get_tensor(k) for k in f.keys()}
    if "torch_cpu" not in states:
        raise ValueError(f"checkpoint: {path} lacks the torch_cpu RNG state")
    set_all = _device_rng_function(device_type, "set")
    try:
        torch.set_rng_state(states["torch_cpu"])
        if set_all is not None:
            device_states = _device_rng_states(states, device_type,
                                               int(torch_device_module(device_type).device_count()))
            if device_states:
                set_all(device_states)
    except (RuntimeError, TypeError, IndexError) as exc:  # wrong sizes or dtypes of the saved states
        raise ValueError(f"checkpoint: {path} does not hold valid RNG states ({exc})") from None


# ---------------------------------------------------------------------------------- save / load

# What a write does, in order; ``on_stage`` is called with each name before it (tests stop the writer there).
WRITE_STAGES = ("model", "optimizer", "rng", "trainer_state", "fsync", "set_aside", "rename", "latest",
                "remove_aside", "prune")


def save_checkpoint(root: Path, *, step: int, model: torch.nn.Module, optimizer, data_state: dict,
                    world_size: int, device_type: str, keep_last: int, write: bool = True,
                    history: Optional[Sequence[str]] = None,
                    on_stage: Optional[Callable[[str], None]] = None) -> Optional[Path]:
    """Write checkpoint ``step`` under ``root`` atomically; keep the newest ``keep_last`` of this run's
    checkpoints. Returns its folder.

    ``history``: this run's earlier checkpoints in ``root``, newest first (a fresh run passes ``[]`` at its
    first write); None continues the history ``root/latest`` records. Only those are ever pruned (see
    ``checkpoint_folders.py``). With sharded (DTensor) parameters every rank must call this: the tensors are
    gathered whole, and only the rank with ``write=True`` writes (the others return None)."""
    model_state = _model_tensors_to_save(model, keep=write)
    optimizer_tensors, optimizer_meta = _flatten_optimizer(optimizer.state_dict(), keep=write)
    if not write:
        return None
    stage = on_stage or (lambda name: None)
    root.mkdir(parents=True, exist_ok=True)
    folders.recover(root)  # what a killed earlier writer left (its half-written folder, a step set aside)
    if history is None:
        try:
            history = folders.read_history(root)
        except ValueError:  # an unreadable `latest` is replaced below; nothing it names is pruned
            history = []
    tmp = folders.temp_folder(root, step)
    tmp.mkdir()
    stage("model")
    save_file(model_state, str(tmp / "model.safetensors"))
    stage("optimizer")
    save_file(optimizer_tensors, str(tmp / "optimizer.safetensors"), metadata=optimizer_meta)
    stage("rng")
    save_file(_rng_tensors(device_type), str(tmp / "rng.safetensors"))
    stage("trainer_state")
    _write_json(tmp / "trainer_state.json", {
        "format_version": FORMAT_VERSION, "step": step, "data": data_state, "world_size": world_size,
        "python_rng": random.getstate(),
    })
    stage("fsync")
    for f in tmp.iterdir():
        folders.fsync_path(f)
    folders.fsync_path(tmp)
    return folders.publish(root, tmp, step, keep_last=keep_last, history=history, on_stage=on_stage)


def _python_rng_state(value: Any, path: Path) -> tuple:
    """``trainer_state.json``'s python_rng as ``random.setstate`` takes it: [version, [625 words], gauss_next]."""
    ok = (isinstance(value, list) and len(value) == 3 and isinstance(value[0], int) and
          isinstance(value[1], list) and len(value[1]) == 625 and
          all(isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2 ** 32 for w in value[1]) and
          (value[2] is None or (isinstance(value[2], float) and math.isfinite(value[2]))))
    if not ok:
        raise ValueError(f"checkpoint: {path} python_rng: expected [version, [625 ints in [0, 2**32)], null or a "
                         f"float] as random.getstate() writes it, got {type(value).__name__} {str(value)[:60]}")
    return value[0], tuple(value[1]), value[2]


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer, total_steps: int, world_size: int,
                    device_type: str) -> dict[str, Any]:
    """Restore model, optimizer and RNG from checkpoint folder ``path``; return the trainer state
    (``step``, ``data``). ``world_size`` is this run's; the checkpoint's may differ (see the module
    docstring). Everything read is validated before use: the model file's header and the whole
    optimizer state before either is loaded, so a mismatched or crafted file is a ValueError naming the
    file and tensor or key, not a failure inside the optimizer's next step."""
    path = Path(path)
    state_path = path / "trainer_state.json"
    state = read_json(state_path, root=path, max_bytes=MAX_STATE_BYTES)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint: {state_path}: expected a JSON object, got {type(state).__name__}")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint: {state_path} format_version: expected {FORMAT_VERSION}, "
                         f"got {state.get('format_version')!r:.60}")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= total_steps:
        raise ValueError(f"checkpoint: {state_path} step: expected an int in [0, {total_steps}], got {step!r:.60}")
    saved_world = state.get("world_size")
    if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
        raise ValueError(f"checkpoint: {state_path} world_size: expected an int >= 1, got {saved_world!r:.60}")
    # Every rank reads the same global batch and takes its rows of it, so the data order does not depend on
    # the world size: any world size that divides the batch (checked by the trainer) may resume.
    if not isinstance(state.get("data"), dict):
        raise ValueError(f"checkpoint: {state_path} data: expected the data position (an object), "
                         f"got {state.get('data')!r:.60}")
    python_rng = _python_rng_state(state.get("python_rng"), state_path)
    _check_model_file(path / "model.safetensors", model, path)
    param_names = {id(p): name for name, p in model.named_parameters()}
    optimizer_state = _unflatten_optimizer(path / "optimizer.safetensors", optimizer, param_names)
    load_model_weights(model, path / "model.safetensors", checked=True)
    optimizer.load_state_dict(optimizer_state)
    _restore_rng(path / "rng.safetensors", device_type)
    try:
        random.setstate(python_rng)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"checkpoint: {state_path} python_rng: not a valid Python RNG state ({exc})") from None
    return {"step": step, "data": state["data"]}
