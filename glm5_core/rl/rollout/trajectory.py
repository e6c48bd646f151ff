"""What the trainer receives: token ids exactly as sampled (TITO), with per-token metadata.

Legend: L tokens of one sample (context + generated), aligned lists.

``loss_mask[i]`` is 1 for tokens the policy sampled and 0 for prompt / tool / environment tokens;
``logprobs[i]`` and ``versions[i]`` are the engine's recorded log-prob and weight version of sampled
tokens (0.0 and -1 elsewhere). ``routed_experts`` / ``indexer_topk``, when the engine returned them, are the
experts / DSA keys the engine used at every position but the last (routing / index replay).
A trajectory whose context was rewritten (context management) yields
several samples, each an append-only token sequence; all share the trajectory's reward.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class Sample:
    """One append-only token sequence of a trajectory."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)  # one per generation
    # replay traces of tokens[:-1] (None: not recorded): int [L-1, M, K] experts, int [L-1, F, Ki] DSA keys
    routed_experts: Optional[torch.Tensor] = None
    indexer_topk: Optional[torch.Tensor] = None

    def append(self, tokens: list[int], *, sampled: bool, logprobs: Optional[list[float]] = None,
               versions: Optional[list[int]] = None) -> None:
        n = len(tokens)
        if sampled and (logprobs is None or versions is None or len(logprobs) != n or len(versions) != n):
            raise ValueError(f"logprobs / versions: expected {n} entries for {n} sampled tokens")
        self.tokens.extend(int(t) for t in tokens)
        self.loss_mask.extend([1 if sampled else 0] * n)
        self.logprobs.extend([float(x) for x in logprobs] if sampled else [0.0] * n)
        self.versions.extend([int(v) for v in versions] if sampled else [-1] * n)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def oldest_version(self) -> int:
        sampled = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(sampled) if sampled else -1

    def check(self) -> None:
        n = len(self.tokens)
        assert len(self.loss_mask) == n and len(self.logprobs) == n and len(self.versions) == n


@dataclasses.dataclass
class Trajectory:
    """A finished episode: its samples, reward and bookkeeping."""

    trajectory_id: str
    group_id: str
    samples: list[Sample]
    reward: float
    num_turns: int = 1
    info: dict[str, float] = dataclasses.field(default_factory=dict)
    env_failed: bool = False  # an environment crash is not a task failure: such trajectories are not trained
    truncated: bool = False  # cut by rollout.max_len before the episode ended (train.truncation says how it trains)

    @property
    def oldest_version(self) -> int:
        versions = [s.oldest_version() for s in self.samples if s.num_generated]
        return min(versions) if versions else -1

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    @property
    def num_generated(self) -> int:
        return sum(s.num_generated for s in self.samples)
