"""Hierarchical context management for long multi-turn tool use.

The context is the task prompt followed by turns (the model's tokens, then the tool's reply). Two levels:

1. keep-recent: only the last ``keep_recent`` tool results are shown verbatim; older ones are folded to a
   short placeholder (the model's own tokens stay);
2. discard-all: if the rendered context still exceeds ``token_budget``, the whole tool history is dropped:
   the context restarts as prompt + a marker + the latest tool result, and the agent continues from there.

Tokens are kept as ids (the model's are exactly what it sampled); only the environment's own text is encoded.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from glm5_core.rl.rollout.envs.codec import ByteCodec

FOLDED_TEXT = "[..]\n"
DROPPED_TEXT = "[history dropped]\n"


@dataclasses.dataclass
class Turn:
    model_tokens: list[int]
    tool_tokens: list[int]
    folded_tokens: Optional[list[int]] = None  # what replaces tool_tokens once folded (None: the FOLDED_TEXT ids)


class ContextManager:
    def __init__(self, prompt_tokens: list[int], codec: ByteCodec, *, keep_recent: int = 5,
                 token_budget: int = 32768):
        if not isinstance(keep_recent, int) or keep_recent < 1:
            raise ValueError(f"keep_recent: expected an int >= 1, got {keep_recent!r}")
        if not isinstance(token_budget, int) or token_budget < len(prompt_tokens) + 1:
            raise ValueError(f"token_budget: expected an int > prompt length {len(prompt_tokens)}, "
                             f"got {token_budget!r}")
        self.prompt = list(prompt_tokens)
        self.keep_recent = keep_recent
        self.token_budget = token_budget
        self.turns: list[Turn] = []
        self._folded = codec.encode(FOLDED_TEXT)
        self._dropped = codec.encode(DROPPED_TEXT)
        self._history_dropped = False
        self.num_folds = 0
        self.num_drops = 0

    def add_turn(self, model_tokens: list[int], tool_tokens: list[int],
                 folded_tokens: Optional[list[int]] = None) -> None:
        self.turns.append(Turn(list(model_tokens), list(tool_tokens),
                               None if folded_tokens is None else list(folded_tokens)))

    def _render(self) -> list[int]:
        out = list(self.prompt) + (list(self._dropped) if self._history_dropped else [])
        first_verbatim = len(self.turns) - self.keep_recent
        for i, turn in enumerate(self.turns):
            out += turn.model_tokens
            if i >= first_verbatim:
                out += turn.tool_tokens
            else:
                out += self._folded if turn.folded_tokens is None else turn.folded_tokens
        return out

    def render(self) -> list[int]:
        """The context to send next (applies keep-recent, then discard-all past the budget)."""
        tokens = self._render()
        if len(tokens) > self.token_budget and len(self.turns) > 1:
            self.turns = [Turn([], self.turns[-1].tool_tokens)]  # drop the whole tool history
            self._history_dropped = True
            self.num_drops += 1
            tokens = self._render()
        self.num_folds = max(0, len(self.turns) - self.keep_recent)
        return tokens
