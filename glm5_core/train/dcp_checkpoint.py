"""Sharded training checkpoints (expert parallelism, ``parallel.ep``) with ``torch.distributed.checkpoint``.

Layout of ``<output_dir>/checkpoints/step_00000042/`` (the same folders, ``latest`` and pruning as
``checkpoint.py``, by ``checkpoint_folders.py``):
  dcp/                    the model's and the optimizer's tensors, written by every rank (its own shards only:
                          no rank gathers the whole model), through DCP's HuggingFace storage writer:
                          safetensors files whose headers say where each shard sits in its whole tensor
  rng.safetensors         rank 0's torch RNG states
  trainer_state.json      step, data position, Python RNG state, world size, ``"format": "dcp"``, the EP size

Names are global whatever the EP size: ``model/<state-dict name>`` (an expert is
``...mlp.experts.<global id>...``, see ``LocalExperts``) and ``optimizer/<part>/<parameter name>/<state key>``.
DCP reshards on load: each rank reads only the slices of the tensors it holds now, so a checkpoint written at
EP=2 on 2 ranks resumes at EP=4 on 4 ranks, at EP=1, or on one process (every expert whole there). The optimizer
state is read into tensors laid out like their parameters (DTensors for sharded ones) and set into the
optimizers afterwards; the param groups' hyper-parameters come from the config (as the trainer restores them
on every resume).

Everything is safetensors + JSON (DCP's default storage pickles its metadata; the HF storage does not). A
checkpoint's tensors are checked against the model before any is loaded: every model name present with its
shape, every optimizer entry of a parameter this rank holds with the parameter's shape or a scalar, all finite.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Optional

import torch

from glm5_core.safe_files import read_json
from glm5_core.train import checkpoint_folders as folders
from glm5_core.train.checkpoint import (
    FORMAT_VERSION,
    MAX_STATE_BYTES,
    _python_rng_state,
    _restore_rng,
    _rng_tensors,
    _write_json,
)
from glm5_core.train.fsdp import is_dtensor

DCP_DIR = "dcp"
FORMAT = "dcp"


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def is_dcp_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _model_entries(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"model/{name}": t for name, t in model.state_dict().items()}


def _optimizer_entries(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for part, opt in optimizer.optimizers.items():
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        raise ValueError(f"checkpoint: optimizer {part} state {key!r} of {names[id(p)]} is a "
                                         f"{type(value).__name__}; the sharded format stores tensors only")
                    out[f"optimizer/{part}/{names[id(p)]}/{key}"] = value
    return out


def save(root: Path, *, step: int, model: torch.nn.Module, optimizer, data_state: dict, world_size: int,
         device_type: str, ep: Optional[int], keep_last: int, is_main: bool,
         history: Optional[list[str]]) -> Optional[Path]:
    """Write checkpoint ``step`` under ``root``: every rank its shards, rank 0 (``is_main``) the rest, then
    rank 0 publishes the folder atomically (``checkpoint_folders.publish``). Every rank must call this.
    Returns the folder on rank 0, None elsewhere."""
    dcp = _dcp()
    tmp = folders.temp_folder(root, step)  # rank 0's name (it holds rank 0's pid): every rank writes there
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        shared = [str(tmp)]
        torch.distributed.broadcast_object_list(shared, src=0)
        tmp = Path(shared[0])
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        folders.recover(root)
        if history is None:
            try:
                history = folders.read_history(root)
            except ValueError:
                history = []
        tmp.mkdir()
    _barrier()
    state = {**_model_entries(model), **_optimizer_entries(model, optimizer)}
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp / DCP_DIR), save_distributed=distributed))
    _barrier()
    if not is_main:
        return None
    from safetensors.torch import save_file

    save_file(_rng_tensors(device_type), str(tmp / "rng.safetensors"))
    _write_json(tmp / "trainer_state.json", {
        "format_version": FORMAT_VERSION, "format": FORMAT, "step": step, "data": data_state,
        "world_size": world_size, "expert_parallel": ep, "python_rng": random.getstate(),
    })
    for f in tmp.rglob("*"):
        folders.fsync_path(f)
    folders.fsync_path(tmp / DCP_DIR)
    folders.fsync_path(tmp)
    return folders.publish(root, tmp, step, keep_last=keep_last, history=history)


def _saved_tensors(path: Path) -> dict[str, Any]:
    """{name: TensorStorageMetadata} of the checkpoint's tensors (read from the safetensors headers)."""
    dcp = _dcp()
    meta = dcp.HuggingFaceStorageReader(str(path / DCP_DIR)).read_metadata()
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, dcp.TensorStorageMetadata)}


def _expert_prefix(name: str) -> Optional[str]:
    """``a.b.mlp.experts`` of ``a.b.mlp.experts.5.gate_proj.weight`` (None for other names)."""
    head, sep, _ = name.partition(".experts.")
    return head + ".experts" if sep else None


def _experts_held_elsewhere(model: torch.nn.Module) -> set[str]:
    """The module names of the expert-parallel layers' local experts (each holds only some experts)."""
    from glm5_core.model.moe import LocalExperts

    return {name for name, module in model.named_modules() if isinstance(module, LocalExperts)}


def load(path: Path, *, model: torch.nn.Module, optimizer, total_steps: int, device_type: str) -> dict[str, Any]:
    """Restore model, optimizer and RNG from sharded checkpoint ``path`` at this run's EP size and world size;
    return the trainer state (``step``, ``data``). Every rank must call this."""
    dcp = _dcp()
    path = Path(path)
    state_path = path / "trainer_state.json"
    state = read_json(state_path, root=path, max_bytes=MAX_STATE_BYTES)
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint: {state_path}: expected a sharded (format 'dcp', version {FORMAT_VERSION}) "
                         f"trainer state")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= total_steps:
        raise ValueError(f"checkpoint: {state_path} step: expected an int in [0, {total_steps}], got {step!r:.60}")
    if not isinstance(state.get("data"), dict):
        raise ValueError(f"checkpoint: {state_path} data: expected the data position (an object)")
    python_rng = _python_rng_state(state.get("python_rng"), state_path)
    saved = _saved_tensors(path)
    wanted = _model_entries(model)
    for name, t in wanted.items():
        meta = saved.get(name)
        if meta is None:
            raise ValueError(f"checkpoint: {path / DCP_DIR} lacks {name[len('model/'):]} (written for another model?)")
        if tuple(meta.size) != tuple(t.shape):
            raise ValueError(f"checkpoint: {name[len('model/'):]} in {path / DCP_DIR}: expected shape "
                             f"{tuple(t.shape)}, got {tuple(meta.size)}")
    params = dict(model.named_parameters())
    others = _experts_held_elsewhere(model)
    parts = {id(p): part for part, opt in optimizer.optimizers.items() for g in opt.param_groups for p in g["params"]}
    slots: dict[str, tuple[str, torch.Tensor, str]] = {}  # entry -> (part, parameter, state key)
    for name, meta in saved.items():
        if not name.startswith("optimizer/"):
            continue
        pieces = name.split("/")
        if len(pieces) != 4:
            raise ValueError(f"checkpoint: unexpected entry {name!r:.120} in {path / DCP_DIR}")
        _, part, pname, key = pieces
        p = params.get(pname)
        if p is None and _expert_prefix(pname) in others:  # an expert another EP rank holds: its rank reads it
            continue
        if p is None:
            raise ValueError(f"checkpoint: optimizer state of {pname!r:.120}, which this model does not have")
        if parts.get(id(p)) != part:
            raise ValueError(f"checkpoint: optimizer state of {pname} under {part!r}, this run steps it with "
                             f"{parts.get(id(p))!r}")
        if tuple(meta.size) == tuple(p.shape):
            wanted[name] = torch.zeros_like(p.detach(), dtype=meta.properties.dtype)  # laid out like p
        elif tuple(meta.size) == ():
            wanted[name] = torch.zeros((), dtype=meta.properties.dtype)
        else:
            raise ValueError(f"checkpoint: optimizer state {name} has shape {tuple(meta.size)}, expected "
                             f"{tuple(p.shape)} (its parameter's) or a scalar")
        slots[name] = (part, p, key)
    dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(path / DCP_DIR)))
    for name, t in wanted.items():
        local = t.to_local() if is_dtensor(t) else t
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            raise ValueError(f"checkpoint: {name} in {path / DCP_DIR} holds non-finite values")
    for name, (part, p, key) in slots.items():
        optimizer.optimizers[part].state[p][key] = wanted[name]
    _restore_rng(path / "rng.safetensors", device_type)
    random.setstate(python_rng)
    return {"step": step, "data": state["data"]}
