"""Multi-turn calculator-tool task with long-tailed turn counts.

Task: add ``n`` integers that the environment reveals one per turn (like an agent that must look things up).
The prompt shows the first number; each model turn is one calculator call (its first line is evaluated by
:func:`calculate`); the tool replies with the result and the next number. After the last number the tool
asks for the answer, and the reward is 1.0 iff the model's final line is exactly the total.
``n`` is long-tailed: ``1 + floor(pareto(alpha))`` capped at ``max_numbers``, so most episodes are short and a
few are very long, which is what leaves a synchronous RL loop waiting on stragglers.

The distribution, stated: an episode that runs to its answer takes ``n`` model turns (``n - 1`` calculator calls,
then the answer; every member of a group gets the same numbers). With Pareto scale 1, ``P(n >= k) = (k - 1) **
-alpha`` for ``max(2, min_numbers) <= k <= max_numbers`` (``n >= 2`` always unless ``max_numbers`` is 1), and
``n = max_numbers`` with probability ``(max_numbers - 1) ** -alpha``. ``pareto_alpha: 1.0, max_numbers: 50``
(``configs/rl_longtail.yaml``) gives episodes of 2 to 50 turns: half take 2, a quarter 4 or more, 5% 21 or more,
2.5% 41 or more, 2% the full 50; mean ``1 + H_49`` = 5.48 turns (H: the harmonic number). A smaller alpha
fattens the tail. ``tests/rl/rollout/test_calculator_turns.py`` checks these figures against draws.

With a chat tokenizer (``rollout.tokenizer``) the same conversation goes through its chat template
(:mod:`chat_prompts`): the prompt is a user message, each tool result a ``role: tool`` message followed by a user
message with the next number (or ``answer:``), appended after the model's sampled ids; a folded tool result is a
``role: tool`` message ``[..]`` (the user message after it stays).
"""
from __future__ import annotations

import random

from glm5_core.rl.rollout.envs.arithmetic import score_answer
from glm5_core.rl.rollout.envs.base import Environment, Episode, TurnLimits
from glm5_core.rl.rollout.envs.calculator_tool import ToolError, calculate
from glm5_core.rl.rollout.envs.chat_prompts import ChatTurns, model_text, stop_tokens, uses_chat_template
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.envs.context import FOLDED_TEXT, ContextManager
from glm5_core.rl.rollout.envs.rng_state import load_rng_state, rng_state_dict


def long_tailed_count(rng: random.Random, alpha: float, cap: int) -> int:
    return min(cap, 1 + int(rng.paretovariate(alpha)))


class CalculatorEpisode(Episode):
    def __init__(self, group_id: str, numbers: list[int], codec: ByteCodec, *, max_new_tokens: int,
                 keep_recent: int, token_budget: int):
        self.group_id = group_id
        self.numbers = numbers
        self._codec = codec
        text = f"Add the numbers with calc. First: {numbers[0]}\n"
        self._asked_answer = len(numbers) == 1
        self._chat = None
        if uses_chat_template(codec):
            self._chat = ChatTurns(codec, text + ("answer:" if self._asked_answer else ""))
            prompt = self._chat.prompt
        else:
            prompt = codec.encode(text)
        self.context = ContextManager(prompt, codec, keep_recent=keep_recent, token_budget=token_budget)
        self._limits = TurnLimits(max_new_tokens, stop_tokens(codec, "\n"))
        self._revealed = 1
        self._turns = 0
        self._final: list[int] = []
        if self._asked_answer and self._chat is None:
            self.context.prompt += codec.encode("answer:")

    def context_tokens(self) -> list[int]:
        return self.context.render()

    def turn_limits(self) -> TurnLimits:
        return self._limits

    def observe(self, output_ids: list[int]) -> bool:
        self._turns += 1
        if self._asked_answer:
            self._final = list(output_ids)
            return True
        expression = model_text(self._codec, output_ids).split("\n", 1)[0]
        try:
            result = str(calculate(expression))
        except ToolError as exc:
            result = f"error: {exc}"
        shown = None  # the number this turn reveals
        if self._revealed < len(self.numbers):
            shown = self.numbers[self._revealed]
            self._revealed += 1
        if self._revealed == len(self.numbers):
            self._asked_answer = True
        ask = (f"next: {shown}\n" if shown is not None else "") + ("answer:" if self._asked_answer else "")
        if self._chat is None:
            reply = f"<tool>{result}</tool>" + (" " if shown is not None else "") + ask
            self.context.add_turn(output_ids, self._codec.encode(reply))
        else:
            user = {"role": "user", "content": ask}  # kept when the tool result is folded
            tool_ids, folded_ids = self._chat.reply(output_ids, [{"role": "tool", "content": result}, user],
                                                    folded=[{"role": "tool", "content": FOLDED_TEXT.strip()}, user])
            self.context.add_turn(output_ids, tool_ids, folded_ids)
        return False

    @property
    def reward(self) -> float:
        return score_answer(model_text(self._codec, self._final), sum(self.numbers))

    @property
    def num_turns(self) -> int:
        return self._turns

    def info(self) -> dict[str, float]:
        return {"numbers": float(len(self.numbers)), "history_drops": float(self.context.num_drops)}


class CalculatorEnv(Environment):
    def __init__(self, *, pareto_alpha: float = 1.2, max_numbers: int = 16, min_numbers: int = 1, max_value: int = 9,
                 max_new_tokens: int = 8, keep_recent: int = 5, token_budget: int = 32768,
                 codec: ByteCodec = None, seed: int = 0):
        if not pareto_alpha > 0:
            raise ValueError(f"pareto_alpha: expected > 0, got {pareto_alpha!r}")
        if not isinstance(max_numbers, int) or max_numbers < 1:
            raise ValueError(f"max_numbers: expected an int >= 1, got {max_numbers!r}")
        if not isinstance(min_numbers, int) or not 1 <= min_numbers <= max_numbers:
            raise ValueError(f"min_numbers: expected an int in [1, max_numbers={max_numbers}], got {min_numbers!r}")
        # checked here, not at the first episode (in a rollout thread, as a bare KeyError / randrange error)
        for name, value, low in (("max_value", max_value, 0), ("max_new_tokens", max_new_tokens, 1),
                                 ("keep_recent", keep_recent, 1), ("token_budget", token_budget, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        self.pareto_alpha, self.max_numbers, self.max_value = pareto_alpha, max_numbers, max_value
        self.min_numbers = min_numbers
        self.max_new_tokens, self.keep_recent, self.token_budget = max_new_tokens, keep_recent, token_budget
        self.codec = codec or ByteCodec()
        self._rng = random.Random(seed)

    def state_dict(self) -> dict:
        return rng_state_dict(self._rng)

    def load_state_dict(self, state: dict) -> None:
        load_rng_state(self._rng, state)

    def new_group(self, group_id: str, group_size: int) -> list[Episode]:
        n = max(self.min_numbers, long_tailed_count(self._rng, self.pareto_alpha, self.max_numbers))
        numbers = [self._rng.randint(0, self.max_value) for _ in range(n)]
        return [CalculatorEpisode(group_id, list(numbers), self.codec, max_new_tokens=self.max_new_tokens,
                                  keep_recent=self.keep_recent, token_budget=self.token_budget)
                for _ in range(group_size)]
