"""Single-turn arithmetic with an exact-match reward.

Prompt ``"{a}+{b}="`` (a, b drawn from ``[0, max_operand]``); the policy writes at most ``max_new_tokens``
bytes, stopping at a newline. Reward 1.0 iff the first line of the answer, with surrounding spaces removed,
is exactly ``str(a + b)``; else 0.0. With single-digit operands the answer is one or two byte tokens, which
a byte-level model pretrained on source code can reach by sampling, so RL has a signal from the start.
"""
from __future__ import annotations

import random
from typing import Dict, List

from glm5_core.rl.rollout.envs.base import Environment, Episode, TurnLimits
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.envs.rng_state import load_rng_state, rng_state_dict


def score_answer(text: str, expected: int) -> float:
    return 1.0 if text.split("\n", 1)[0].strip() == str(expected) else 0.0


class ArithmeticEpisode(Episode):
    def __init__(self, group_id: str, a: int, b: int, codec: ByteCodec, template: str, max_new_tokens: int):
        self.group_id = group_id
        self.a, self.b = a, b
        self._codec = codec
        self._prompt = codec.encode(template.format(a=a, b=b))
        self._limits = TurnLimits(max_new_tokens, (codec.token("\n"),))
        self._answer: List[int] = []
        self._turns = 0

    def context_tokens(self) -> List[int]:
        return list(self._prompt)

    def turn_limits(self) -> TurnLimits:
        return self._limits

    def observe(self, output_ids: List[int]) -> bool:
        self._answer = list(output_ids)
        self._turns += 1
        return True

    @property
    def reward(self) -> float:
        return score_answer(self._codec.decode(self._answer), self.a + self.b)

    @property
    def num_turns(self) -> int:
        return self._turns

    def info(self) -> Dict[str, float]:
        return {"answer_len": float(len(self._answer))}


class ArithmeticEnv(Environment):
    def __init__(self, *, max_operand: int = 4, template: str = "{a}+{b}=", max_new_tokens: int = 3,
                 codec: ByteCodec = None, seed: int = 0):
        if not isinstance(max_operand, int) or not 0 <= max_operand <= 10**6:
            raise ValueError(f"max_operand: expected an int in [0, 1e6], got {max_operand!r}")
        if "{a}" not in template or "{b}" not in template:
            raise ValueError(f"template: expected placeholders {{a}} and {{b}}, got {template!r}")
        try:
            template.format(a=0, b=0)
        except (KeyError, IndexError, ValueError) as exc:  # '{c}', '{}', an unmatched brace
            raise ValueError(f"template: expected no placeholder but {{a}} and {{b}} (literal braces doubled), "
                             f"got {template!r} ({type(exc).__name__}: {exc})") from None
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        self.max_operand = max_operand
        self.template = template
        self.max_new_tokens = max_new_tokens
        self.codec = codec or ByteCodec()
        self._rng = random.Random(seed)

    def state_dict(self) -> Dict:
        return rng_state_dict(self._rng)

    def load_state_dict(self, state: Dict) -> None:
        load_rng_state(self._rng, state)

    def problems(self) -> List[tuple]:
        """Every (a, b) of the task: the fixed evaluation set."""
        n = self.max_operand + 1
        return [(a, b) for a in range(n) for b in range(n)]

    def episode(self, group_id: str, a: int, b: int) -> ArithmeticEpisode:
        return ArithmeticEpisode(group_id, a, b, self.codec, self.template, self.max_new_tokens)

    def new_group(self, group_id: str, group_size: int) -> List[Episode]:
        a = self._rng.randint(0, self.max_operand)
        b = self._rng.randint(0, self.max_operand)
        return [self.episode(group_id, a, b) for _ in range(group_size)]
