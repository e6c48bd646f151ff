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


def parallel_world() -> tuple[int, int]:
    """(rank, world size) of this process under torchrun (``RANK``, ``WORLD_SIZE``); (0, 1) without it."""
    from glm5_core.train.distributed import _env_int

    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)


def torchrun_problem(cfg, resume: bool) -> Optional[str]:
    """What ``glm5 rl`` under torchrun (several ranks) does not do yet, in one line naming the setting; None when
    the run can go ahead. Rank 0 runs the driver (rollouts, weight pushes to spawned engines from its weight
    files, evaluation, metrics), every rank its share of each training step (``PolicyTrainer.follow``)."""
    if cfg.parallel.strategy != "fsdp2":
        return (f"parallel.strategy: glm5 rl under torchrun trains the policy with fsdp2 (--parallel fsdp2 or "
                f"ep=N); ddp is not built for the RL trainer, got {cfg.parallel.strategy!r}")
    if resume:
        return ("--resume: glm5 rl under torchrun writes no resume points (their sharded format is not built); "
                "resume a run started on one process there")
    if cfg.rollout.weight_sync != "disk":
        return (f"rollout.weight_sync: glm5 rl under torchrun pushes weights from its weight files ('disk'); "
                f"{cfg.rollout.weight_sync!r} (a broadcast from the sharded policy) is not built")
    if cfg.rollout.engine_urls is not None:
        return ("rollout.engine_urls: glm5 rl under torchrun spawns its engines; external engines (an HF directory "
                "written from the sharded policy) are not built")
    return None


def parallelize_policy(cfg, model):
    """``parallel`` of RLConfig ``cfg`` applied to the policy by the pretraining driver's own path
    (``train.fsdp.parallelize``); returns what it did (a ``Parallelized``, for ``PolicyTrainer(parallel=...)``), or
    None on one process with the section left at its default. One process: ``parallel.ep: 1`` gives the
    expert-parallel layout without sharding (every expert here, the batch-invariant experts kernel: the bitwise
    baseline of any EP size); a larger ``ep`` is refused naming the world size, as by ``glm5 pretrain``. Under
    torchrun every rank calls it on a policy built alike (the process group is up: ``glm5 rl``'s CLI)."""
    from glm5_core.train import fsdp

    rank, world = parallel_world()
    if cfg.parallel.ep is None and world == 1:
        return None
    return fsdp.parallelize(model, strategy=cfg.parallel.strategy, ep=cfg.parallel.ep,
                            device_type=next(model.parameters()).device.type, rank=rank, world_size=world)


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
