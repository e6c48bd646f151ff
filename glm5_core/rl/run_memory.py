"""Whether an RL run fits this machine's memory, from the config alone (before a policy or engine is built).

A lower bound (``glm5_core.model.sizing``): the trainer's fp32 policy with its gradients and AdamW's two
states, the activations and logits of one micro-batch of ``rollout.max_len`` tokens, and, with the ``local``
executor, every engine's own copy of the weights and its KV cache of ``max_batch`` x ``max_len`` positions;
plus the token lists of the trajectories in flight and buffered.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from glm5_core.memory_budget import FLOAT_BYTES, fit_problem
from glm5_core.rl.config import RLConfig

TRAJECTORY_BYTES_PER_TOKEN = 24  # token id, log-prob and loss-mask list slots (8-byte pointers) per position
ADAMW_COPIES = 4  # weights, gradients, two moments


@dataclasses.dataclass(frozen=True)
class RunSize:
    """What an RL run's memory depends on."""

    model: Any  # GLM5Config
    local_engines: int  # engines on this machine (0 with the ray executor: they may run anywhere)
    max_batch: int
    max_len: int
    micro_batch_size: int
    trajectories: int  # in flight and buffered at most

    def memory_parts(self) -> dict[str, int]:
        from glm5_core.model import sizing

        params = sizing.parameter_count(self.model)
        tokens = self.micro_batch_size * self.max_len
        cache = self.max_batch * self.max_len * sizing.cache_floats_per_token(self.model)
        return {"trainer policy and optimizer state": ADAMW_COPIES * FLOAT_BYTES * params,
                "trainer activations": FLOAT_BYTES * tokens * (sizing.activation_floats_per_token(self.model)
                                                               + sizing.logit_floats_per_token(self.model)),
                "engine weights and KV caches": self.local_engines * FLOAT_BYTES * (params + cache),
                "trajectories": self.trajectories * self.max_len * TRAJECTORY_BYTES_PER_TOKEN}


def _size(cfg: RLConfig, model) -> RunSize:
    r = cfg.rollout
    local_engines = r.num_engines if cfg.executor == "local" and r.engine_urls is None else 0
    return RunSize(model, local_engines, r.max_batch, r.max_len,
                   cfg.train.optim.micro_batch_size, r.max_inflight_groups * r.group_size + r.max_buffered)


def memory_problems(cfg: RLConfig, model) -> list[str]:
    """[] when ``cfg`` (an RLConfig) with policy ``model`` (a GLM5Config) fits; else one line naming the key
    that, back at its default, saves the most."""
    default_cfg = RLConfig()
    size = _size(cfg, model)
    preset = type(model).tiny()
    levers: dict[str, RunSize] = {
        f"model.overrides.{key}": dataclasses.replace(size, model=dataclasses.replace(model, **{key: value}))
        for key, value in ((k, getattr(preset, k)) for k in cfg.model.get("overrides", {}))
        if getattr(model, key) != value}
    for key in ("num_engines", "max_batch", "max_len", "max_inflight_groups", "max_buffered", "group_size"):
        if getattr(cfg.rollout, key) != getattr(default_cfg.rollout, key):
            changed = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                           **{key: getattr(default_cfg.rollout, key)}))
            levers[f"rollout.{key}"] = _size(changed, model)
    micro = default_cfg.train.optim.micro_batch_size
    if cfg.train.optim.micro_batch_size != micro:
        levers["train.optim.micro_batch_size"] = dataclasses.replace(size, micro_batch_size=micro)
    problem = fit_problem(size.memory_parts(), {key: lever.memory_parts for key, lever in levers.items()},
                          "rollout.max_batch")
    return [problem] if problem else []
