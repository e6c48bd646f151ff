"""Advantages: group-normalised outcome advantages and the cross-stage distillation term.

Legend: N trajectories, T tokens.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch


def group_normalized(rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-6) -> List[float]:
    """A_i = (R_i - mean_g) / (std_g + eps) within each group g (population std). A group whose rewards are
    all equal carries no signal and gets zeros."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"rewards / group_ids: expected equal lengths, got {len(rewards)} and {len(group_ids)}")
    by_group: Dict[str, List[int]] = {}
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


def distillation_advantage(teacher_logprobs_T: torch.Tensor, policy_logprobs_T: torch.Tensor) -> torch.Tensor:
    """Per-token stopgrad(log pi_teacher - log pi_theta) on the sampled tokens (cross-stage distillation)."""
    if teacher_logprobs_T.shape != policy_logprobs_T.shape:
        raise ValueError(f"teacher_logprobs / policy_logprobs: shapes differ, {tuple(teacher_logprobs_T.shape)} "
                         f"vs {tuple(policy_logprobs_T.shape)}")
    return (teacher_logprobs_T - policy_logprobs_T).detach()
