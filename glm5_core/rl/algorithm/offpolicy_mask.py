"""Partial-rollout masking (slime's ``--mask-offpolicy-in-partial-rollout``, ``train.mask_offpolicy``).

A trajectory that lives through weight pushes (in-flight generations pause at a push and resume under the new
weights, :mod:`glm5_core.rl.fleet.continuation`) holds tokens sampled under several versions, each recorded in
``Sample.versions``. The option takes such tokens out of the loss (``loss_mask`` 0) instead of training them:

* ``"partial"``: tokens sampled under an older version than the trajectory's newest sampled token (what slime
  masks: the part generated before the last push the trajectory lived through);
* an int ``X``: tokens sampled more than ``X`` versions behind ``policy_version`` (the policy the batch trains).

Prompt, tool and environment tokens (``loss_mask`` 0 already) are untouched; the context a masked token gives
the later tokens is kept, only its own loss term goes.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from glm5_core.rl.rollout.trajectory import Sample, Trajectory

Setting = Optional[Union[str, int]]


def _newest(trajectory: Trajectory) -> int:
    return max((v for s in trajectory.samples for v, m in zip(s.versions, s.loss_mask) if m), default=-1)


def _masked_sample(sample: Sample, oldest_kept: int) -> tuple[Sample, int]:
    mask = [m if not m or v >= oldest_kept else 0 for m, v in zip(sample.loss_mask, sample.versions)]
    dropped = sum(sample.loss_mask) - sum(mask)
    return (dataclasses.replace(sample, loss_mask=mask) if dropped else sample), dropped


def mask_offpolicy(batch: list[Trajectory], policy_version: int, setting: Setting) -> tuple[list[Trajectory], int]:
    """``batch`` with the off-policy sampled tokens of ``setting`` masked out of the loss, and how many were
    masked (``setting`` None: the batch as it is, 0)."""
    if setting is None:
        return batch, 0
    out, total = [], 0
    for trajectory in batch:
        oldest_kept = _newest(trajectory) if setting == "partial" else policy_version - int(setting)
        samples, masked = [], 0
        for sample in trajectory.samples:
            sample, dropped = _masked_sample(sample, oldest_kept)
            samples.append(sample)
            masked += dropped
        out.append(dataclasses.replace(trajectory, samples=samples) if masked else trajectory)
        total += masked
    return out, total
