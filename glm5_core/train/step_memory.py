"""Whether a pretraining step fits this machine's memory, from the config alone (before the model is built).

A lower bound (``glm5_core.model.sizing``): fp32 weights, gradients and one optimizer state per parameter,
the activations every backward needs and the logits of every head, for the rows of this machine's ranks
(``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` as torchrun sets them; fsdp2 shards the parameters and their state).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from glm5_core.memory_budget import FLOAT_BYTES, fit_problem
from glm5_core.train.config import DataConfig, LossConfig, TrainConfig


def _env_count(name: str) -> int:
    value = os.environ.get(name, "1")
    return int(value) if value.isdigit() and int(value) >= 1 else 1


@dataclasses.dataclass(frozen=True)
class StepSize:
    """What a training step's memory depends on."""

    model: Any  # GLM5Config
    batch_size: int
    seq_len: int
    mtp_depths: int
    strategy: str

    def memory_parts(self) -> dict[str, int]:
        from glm5_core.model import sizing

        world, here = _env_count("WORLD_SIZE"), _env_count("LOCAL_WORLD_SIZE")
        copies = here / world if self.strategy == "fsdp2" else here
        tokens = self.batch_size * self.seq_len * here // world
        params = sizing.parameter_count(self.model)
        return {"parameters, gradients and optimizer state": int(3 * FLOAT_BYTES * params * copies),
                "activations": FLOAT_BYTES * tokens * sizing.activation_floats_per_token(self.model, self.mtp_depths),
                "logits": FLOAT_BYTES * tokens * sizing.logit_floats_per_token(self.model, self.mtp_depths)}


def memory_problems(cfg: TrainConfig) -> list[str]:
    """[] when a step of ``cfg`` (a TrainConfig) fits; else one line naming the key that saves the most."""
    model = cfg.model_config()
    preset = getattr(type(model), cfg.model.get("preset", "tiny"))()
    size = StepSize(model, cfg.data.batch_size, cfg.data.seq_len, cfg.loss.mtp_depths, cfg.parallel.strategy)
    default = StepSize(preset, DataConfig().batch_size, DataConfig().seq_len, LossConfig().mtp_depths, size.strategy)
    levers: dict[str, StepSize] = {
        f"model.{key}": dataclasses.replace(size, model=dataclasses.replace(model, **{key: getattr(preset, key)}))
        for key in cfg.model if key != "preset" and getattr(model, key) != getattr(preset, key)}
    for name, key in (("batch_size", "data.batch_size"), ("seq_len", "data.seq_len"),
                      ("mtp_depths", "loss.mtp_depths")):
        if getattr(size, name) != getattr(default, name):
            levers[key] = dataclasses.replace(size, **{name: getattr(default, name)})
    problem = fit_problem(size.memory_parts(), {key: lever.memory_parts for key, lever in levers.items()},
                          "data.batch_size")
    return [problem] if problem else []
