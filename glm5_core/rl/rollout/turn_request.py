"""The request of an episode's next turn: its context, and how many tokens it may add within ``rollout.max_len``."""
from __future__ import annotations

import dataclasses
from typing import Optional

from glm5_core.rl.rollout.sampling_seeds import turn_sampling_params


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    context: list[int]  # the episode's tokens so far
    params: dict  # SGLang sampling_params
    cut_by_max_len: bool  # max_new_tokens is below the environment's own limit: max_len left less room


def next_turn(episode, *, max_len: int, temperature: float, top_p: float, run_seed: Optional[int],
              trajectory_id: str, turn: int) -> Optional[TurnRequest]:
    """The request of ``episode``'s next turn (0-based ``turn``); None when its context fills ``max_len``."""
    context = episode.context_tokens()
    limits = episode.turn_limits()
    budget = max_len - len(context)
    if budget < 1:
        return None
    max_new_tokens = min(limits.max_new_tokens, budget)
    params = turn_sampling_params(temperature, top_p, max_new_tokens, limits.stop_token_ids, run_seed,
                                  trajectory_id, turn)
    return TurnRequest(context, params, max_new_tokens < limits.max_new_tokens)
