"""The episode interface the agent loop drives.

An episode owns its context: :meth:`Episode.context_tokens` is what the next generation request sends;
:meth:`Episode.observe` takes the sampled ids (never re-tokenised) and says whether the episode is over.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    max_new_tokens: int
    stop_token_ids: tuple = ()


class Episode(abc.ABC):
    """One attempt at one task. ``group_id`` names the task (advantages normalise within a group)."""

    group_id: str

    @abc.abstractmethod
    def context_tokens(self) -> List[int]:
        """Token ids of the full context for the next generation."""

    @abc.abstractmethod
    def turn_limits(self) -> TurnLimits:
        """Sampling limits of the next generation."""

    @abc.abstractmethod
    def observe(self, output_ids: List[int]) -> bool:
        """Consume the sampled tokens; True when the episode is over."""

    @property
    @abc.abstractmethod
    def reward(self) -> float:
        """Reward of the finished episode."""

    @property
    @abc.abstractmethod
    def num_turns(self) -> int:
        """Generations so far."""

    def info(self) -> Dict[str, float]:
        return {}


class Environment(abc.ABC):
    """Makes groups of episodes: ``group_size`` attempts at the same task."""

    @abc.abstractmethod
    def new_group(self, group_id: str, group_size: int) -> List[Episode]:
        """``group_size`` fresh episodes on one task."""

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run restores so that the next groups get the tasks they would have got (JSON types;
        ``{}``: nothing, the tasks do not depend on the groups drawn before)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"env: {type(self).__name__} keeps no state, got {sorted(state)[:4]}")
    def eval_set(self) -> Optional[List[Callable[[str], Episode]]]:
        """The held-out eval set: per problem, a function of a group id making a fresh episode of it; problems
        :meth:`new_group` never draws. None (the default): no eval set, the run evaluates nothing."""
        return None
