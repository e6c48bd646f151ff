"""The policy an RL run trains: built from ``model.preset`` or ``--checkpoint`` on ``train.device``, or, on a
resume, rebuilt from what the run recorded of it (``starting_policy``, ``run_state``)."""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from glm5_core.rl import run_state, starting_policy
from glm5_core.rl.config import torch_device_name
from glm5_core.rl.device import runtime_device


def policy_device(cfg, backend: Optional[str]) -> torch.device:
    """``train.device``, default: the runtime device of ``backend``."""
    return torch.device(torch_device_name(cfg.train.device, "train.device")) if cfg.train.device \
        else runtime_device(backend)


def build_policy(cfg, checkpoint: Optional[str], backend: Optional[str]):
    """The policy of RLConfig ``cfg``, on ``train.device`` (default: the runtime device of ``backend``)."""
    device = policy_device(cfg, backend)
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "config.json")):
        from glm5_core.model import load_pretrained

        return load_pretrained(checkpoint, backend=backend).to(device)  # a save_pretrained directory
    return _policy_from_preset(cfg, checkpoint, backend).to(device)


def _policy_from_preset(cfg, checkpoint: Optional[str], backend: Optional[str]):
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    preset = cfg.model.get("preset", "tiny")
    if preset != "tiny":
        raise ValueError(f"model.preset: expected 'tiny' (or pass --checkpoint), got {preset!r}")
    torch.manual_seed(cfg.seed)
    model = GLM5ForCausalLM(GLM5Config.tiny(**cfg.model.get("overrides", {})), backend=backend)
    if checkpoint:  # a `glm5 pretrain` checkpoint folder: model.safetensors, architecture from model.preset
        weights = os.path.join(checkpoint, "model.safetensors")
        if not os.path.lexists(weights):  # a FIFO or a link out of the folder is refused by load_model_weights
            raise FileNotFoundError(f"--checkpoint: expected config.json (save_pretrained) or model.safetensors "
                                    f"(glm5 pretrain) in {checkpoint!r}")
        from glm5_core.train.checkpoint import load_model_weights

        try:
            load_model_weights(model, weights)
        except ValueError as exc:
            raise ValueError(f"--checkpoint: weights do not fit model.preset: {exc}") from None
    return model


def parallelize_policy(cfg, model):
    """``parallel`` of RLConfig ``cfg`` applied to the policy by the pretraining driver's own path
    (``train.fsdp.parallelize``); returns what it did (a ``Parallelized``, for ``PolicyTrainer(parallel=...)``), or
    None when the section is left at its default. One process: ``parallel.ep: 1`` gives the expert-parallel
    layout without sharding (every expert here, the batch-invariant experts kernel: the bitwise baseline of any
    EP size); a larger ``ep`` is refused naming the world size, as by ``glm5 pretrain``. Under torchrun
    (``WORLD_SIZE`` > 1) the driver does not run training ranks beside rank 0 yet: refused in one line naming
    what is missing (``PolicyTrainer`` itself trains on the EP x FSDP2 mesh: rl/algorithm/trainer.py)."""
    from glm5_core.train import fsdp
    from glm5_core.train.distributed import _env_int

    world = _env_int("WORLD_SIZE", 1)
    if world > 1:
        raise ValueError(f"parallel: glm5 rl runs in one process (WORLD_SIZE {world}): its driver (rollouts, "
                         f"weight pushes, resume points) does not yet run the other ranks' share of the policy's "
                         f"training steps; run it without torchrun (parallel.ep: 1 or unset)")
    if cfg.parallel.ep is None:
        return None
    return fsdp.parallelize(model, strategy=cfg.parallel.strategy, ep=cfg.parallel.ep,
                            device_type=next(model.parameters()).device.type, rank=0, world_size=1)


def build_starting_policy(cfg, checkpoint: Optional[str], backend: Optional[str], out_dir: str, resume: bool,
                          log: Callable[[str], None]):
    """The policy to train: built from ``checkpoint``; on a resume with a resume point, rebuilt from what the run
    recorded of it, reading nothing of the checkpoint (the weights come from the resume point); on a resume
    with none yet, from the checkpoint, once it is checked unchanged (see ``starting_policy``)."""
    record = run_state.read_run_file(out_dir).get("policy") if resume else None
    if record is None:  # a fresh run, or a run started by a version that recorded nothing
        return build_policy(cfg, checkpoint, backend)
    where = os.path.join(out_dir, run_state.RUN_FILE)
    weights = run_state.resume_point_weights(out_dir, log)
    if weights is None:  # the run starts over from step 0: from the starting weights
        starting_policy.check_unchanged(record, checkpoint, out_dir, where)
        return build_policy(cfg, checkpoint, backend)
    if starting_policy.recorded_config(record, where) is None:
        return build_policy(cfg, None, backend)  # model.preset's architecture
    return starting_policy.rebuild(record, backend, policy_device(cfg, backend), weights, where)
