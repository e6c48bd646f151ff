"""The episode interfaces the rollout runner drives.

An :class:`Episode` owns its context: :meth:`Episode.context_tokens` is what the next generation request sends;
:meth:`Episode.observe` takes the sampled ids (never re-tokenised) and says whether the episode is over.

An :class:`AgentEpisode` drives generation itself (an agent program calling the OpenAI proxy): the runner hands
it the run's ``generate_fn`` and sampling settings, and it returns the recorded samples (:class:`AgentRun`).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional

from glm5_core.rl.rollout.trajectory import Sample


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    max_new_tokens: int
    stop_token_ids: tuple = ()


class Episode(abc.ABC):
    """One attempt at one task. ``group_id`` names the task (advantages normalise within a group)."""

    group_id: str

    @abc.abstractmethod
    def context_tokens(self) -> list[int]:
        """Token ids of the full context for the next generation."""

    @abc.abstractmethod
    def turn_limits(self) -> TurnLimits:
        """Sampling limits of the next generation."""

    @abc.abstractmethod
    def observe(self, output_ids: list[int]) -> bool:
        """Consume the sampled tokens; True when the episode is over."""

    @property
    @abc.abstractmethod
    def reward(self) -> float:
        """Reward of the finished episode."""

    @property
    @abc.abstractmethod
    def num_turns(self) -> int:
        """Generations so far."""

    def info(self) -> dict[str, float]:
        return {}


class Environment(abc.ABC):
    """Makes groups of episodes: ``group_size`` attempts at the same task."""

    @abc.abstractmethod
    def new_group(self, group_id: str, group_size: int) -> list[Episode]:
        """``group_size`` fresh episodes on one task."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run restores so that the next groups get the tasks they would have got (JSON types;
        ``{}``: nothing, the tasks do not depend on the groups drawn before)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"env: {type(self).__name__} keeps no state, got {sorted(state)[:4]}")

    def close(self) -> None:  # noqa: B027 (optional hook: most environments start nothing to release)
        """Release what the environment started (a server, threads); called once when the run ends."""

    def eval_set(self) -> Optional[list[Callable[[str], Episode]]]:
        """The held-out eval set: per problem, a function of a group id making a fresh episode of it; problems
        :meth:`new_group` never draws. None (the default): no eval set, the run evaluates nothing."""
        return None


@dataclasses.dataclass(frozen=True)
class AgentSampling:
    """The run's sampling settings an agent episode generates with (``seed`` None: no per-request seeds; the
    ``return_*`` flags: replay traces to ask of the engines and record)."""

    temperature: float
    top_p: float
    max_len: int
    seed: Optional[int] = None
    return_routed_experts: bool = False
    return_indexer_topk: bool = False


@dataclasses.dataclass
class AgentRun:
    """What an agent episode recorded: its samples (engine ids, mask 1 on sampled tokens), its reward, and
    ``failure`` (None: it finished; else the kind, e.g. ``"exception"``) with ``drop`` (True: not trained)."""

    samples: list[Sample]
    reward: float
    num_turns: int
    info: dict[str, float] = dataclasses.field(default_factory=dict)
    failure: Optional[str] = None
    drop: bool = False


class AgentEpisode(abc.ABC):
    """One attempt at one task by an agent that calls the engines itself; ``group_id`` names the task."""

    group_id: str

    @abc.abstractmethod
    def run(self, trajectory_id: str, generate_fn: Callable[[str, dict], dict], sampling: AgentSampling) -> AgentRun:
        """Play the episode to its end, generating through ``generate_fn(trajectory_id, request)``."""
