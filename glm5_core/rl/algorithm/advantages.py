"""Advantages: group-normalised outcome advantages and the cross-stage distillation term.

Legend: N trajectories, T tokens.

An advantage estimator maps (rewards, group ids) of a batch to one advantage per trajectory;
``train.advantage`` names a built-in (:func:`advantage_estimators`) or a plug-in with that signature.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable

import torch

AdvantageFn = Callable[[Sequence[float], Sequence[str]], list[float]]


def group_normalized(rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-6) -> list[float]:
    """A_i = (R_i - mean_g) / (std_g + eps) within each group g (population std). A group whose rewards are
    all equal carries no signal and gets zeros."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"rewards / group_ids: expected equal lengths, got {len(rewards)} and {len(group_ids)}")
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        by_group.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for members in by_group.values():
        r = torch.tensor([float(rewards[i]) for i in members], dtype=torch.float64)
        centred = r - r.mean()
        std = r.std(unbiased=False)
        flat = float(r.max()) == float(r.min())  # not std == 0: the mean of equal floats may round off them
        values = torch.zeros_like(r) if flat else centred / (std + eps)
        for i, v in zip(members, values.tolist()):
            out[i] = v
    return out


def group_centred(rewards: Sequence[float], group_ids: Sequence[str]) -> list[float]:
    """A_i = R_i - mean_g (Dr. GRPO: no division by the group's std, which up-weights near-uniform groups)."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"rewards / group_ids: expected equal lengths, got {len(rewards)} and {len(group_ids)}")
    by_group: dict[str, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        by_group.setdefault(g, []).append(float(r))
    means = {g: math.fsum(rs) / len(rs) for g, rs in by_group.items()}
    return [float(r) - means[g] for r, g in zip(rewards, group_ids)]


def advantage_estimators() -> dict[str, AdvantageFn]:
    return {"group_normalized": group_normalized, "group_centred": group_centred}


def resolve_advantage(value, key: str = "train.advantage") -> AdvantageFn:
    """The estimator ``value`` names, checked on a two-trajectory batch (a plug-in that does not take
    (rewards, group_ids) or returns anything but one finite float each is refused here, at start)."""
    from glm5_core.rl.plugins import resolve_callable

    fn = resolve_callable(value, advantage_estimators(), key)
    try:
        out = fn([1.0, 0.0], ["g", "g"])
    except Exception as exc:
        raise ValueError(f"{key}: {value!r} failed on rewards [1.0, 0.0] of one group ({type(exc).__name__}: "
                         f"{exc})") from None
    if not isinstance(out, (list, tuple)) or len(out) != 2 or not all(
            isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in out):
        raise ValueError(f"{key}: {value!r} must return one finite float per trajectory, got {out!r:.80}")
    return fn


def distillation_advantage(teacher_logprobs_T: torch.Tensor, policy_logprobs_T: torch.Tensor) -> torch.Tensor:
    """Per-token stopgrad(log pi_teacher - log pi_theta) on the sampled tokens (cross-stage distillation)."""
    if teacher_logprobs_T.shape != policy_logprobs_T.shape:
        raise ValueError(f"teacher_logprobs / policy_logprobs: shapes differ, {tuple(teacher_logprobs_T.shape)} "
                         f"vs {tuple(policy_logprobs_T.shape)}")
    return (teacher_logprobs_T - policy_logprobs_T).detach()
