"""Dynamic sampling (DAPO; slime's ``--dynamic-sampling-filter-path`` with ``check_reward_nonzero_std``).

A group whose rewards are all equal gets zero advantages (``advantages.group_normalized``): it trains
nothing and only dilutes the batch's token mean. With ``dynamic_sampling.enabled`` such a group is held
back when it completes and more groups are sampled until the batch is full of groups with a signal, as
slime does (it drops a group whose reward std is <= 1e-6 and keeps submitting prompts until
``rollout_batch_size`` groups passed). Here a group is dropped when its rewards are exactly equal
(max == min), which is exactly when every advantage of the built-in estimators is zero.

slime samples until the batch is full, however long it takes; here the search is capped: after
``max_rounds`` rollout rounds for one batch the held-back groups fill what is missing (counted as
``filled``), so a task the policy always (or never) solves still trains. A round is one sync-mode call of
the rollout for the missing groups; in async mode, a batch's worth of groups finished since the last batch.
Held-back groups not used by the batch they were sampled for are dropped (counted by reward, slime's
``zero_std_<reward>`` reasons); none is trained later, so none is staler than the batch it came with.
"""
from __future__ import annotations

import collections

from glm5_core.rl.rollout.trajectory import Trajectory


def has_signal(group: list[Trajectory]) -> bool:
    """True unless every reward of the group is the same (the group would train nothing)."""
    rewards = [float(t.reward) for t in group]
    return max(rewards) != min(rewards)


class DynamicSampler:
    """The buffer's side of dynamic sampling: which completed groups are held back, when held-back groups may
    fill a batch, and the counters. Not thread-safe: the buffer calls it under its lock."""

    def __init__(self, *, max_rounds: int, groups_per_batch: int):
        if not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds: expected an int >= 1, got {max_rounds!r}")
        self.max_rounds = max_rounds
        self.groups_per_batch = groups_per_batch
        self.held: list[list[Trajectory]] = []  # equal-reward groups of the batch being assembled, oldest first
        self.completed_since_take = 0
        self.dropped_groups = 0
        self.dropped_by_reward: dict[str, int] = collections.Counter()
        self.filled_groups = 0
        self.dropped_ids: list[str] = []

    def admit(self, group: list[Trajectory]) -> bool:
        """True: the group goes to the batch; False: it is held back. An environment-failed group is admitted
        (the buffer drops it as such)."""
        self.completed_since_take += 1
        if any(t.env_failed for t in group) or has_signal(group):
            return True
        self.held.append(group)
        return False

    def rounds_spent(self) -> bool:
        """Async mode: ``max_rounds`` batches' worth of groups finished since the last batch was taken."""
        return self.completed_since_take >= self.max_rounds * self.groups_per_batch

    def fill(self, missing_groups: int) -> list[list[Trajectory]]:
        """Up to ``missing_groups`` held-back groups, oldest first, to complete a batch."""
        used, self.held = self.held[:missing_groups], self.held[missing_groups:]
        self.filled_groups += len(used)
        return used

    def batch_taken(self) -> None:
        """A batch left the buffer: the groups held back for it are dropped."""
        for group in self.held:
            self.dropped_groups += 1
            self.dropped_by_reward[f"{float(group[0].reward):g}"] += 1
            self.dropped_ids.extend(t.trajectory_id for t in group)
        self.held = []
        self.completed_since_take = 0

    def counters(self) -> dict:
        return {"dynamic_dropped_groups": self.dropped_groups, "dynamic_filled_groups": self.filled_groups,
                "dynamic_dropped_by_reward": dict(sorted(self.dropped_by_reward.items()))}
