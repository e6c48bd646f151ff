"""How a truncated trajectory trains (``train.truncation``).

A trajectory is truncated when ``rollout.max_len`` cut it: its context filled ``max_len`` before the episode
ended, or its last generation got fewer tokens than the environment asked for and stopped on length (the
runner records it in ``Trajectory.truncated``, from the engine's ``finish_reason``). An episode stopped by
its environment's own ``max_new_tokens`` is not truncated: that limit is part of its task.

``as_is``:    trained like any other trajectory (its reward as the environment scored it);
``penalize``: its reward becomes ``train.truncation_reward`` (applied when it enters the buffer, so group
              advantages and dynamic sampling see the penalised reward);
``mask``:     no loss on its tokens (DAPO's overlong filtering); its reward still counts in its group's
              advantage baseline.
"""
from __future__ import annotations

import dataclasses

from glm5_core.rl.rollout.trajectory import Sample, Trajectory


def penalized(trajectory: Trajectory, policy: str, truncation_reward: float) -> Trajectory:
    """``trajectory`` with the reward ``penalize`` gives it (itself under the other policies)."""
    if policy == "penalize" and trajectory.truncated:
        return dataclasses.replace(trajectory, reward=float(truncation_reward))
    return trajectory


def _without_loss(sample: Sample) -> Sample:
    return dataclasses.replace(sample, loss_mask=[0] * len(sample.loss_mask))


def for_training(batch: list[Trajectory], policy: str) -> list[Trajectory]:
    """The batch the trainer steps on: under ``mask`` a truncated trajectory keeps its place (and reward, for
    the baseline) with every loss-mask entry 0."""
    if policy != "mask":
        return batch
    return [dataclasses.replace(t, samples=[_without_loss(s) for s in t.samples]) if t.truncated else t
            for t in batch]
