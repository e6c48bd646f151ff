"""Single-turn arithmetic with an exact-match reward.

Prompt ``"{a}+{b}="`` (a, b drawn from ``[0, max_operand]``); the policy writes at most ``max_new_tokens``
bytes, stopping at a newline. Reward 1.0 iff the first line of the answer, with surrounding spaces removed,
is exactly ``str(a + b)``; else 0.0. With single-digit operands the answer is one or two byte tokens, which
a byte-level model pretrained on source code can reach by sampling, so RL has a signal from the start.

Held-out evaluation: a ``held_out`` share of the (a, b) pairs (a fixed split: ``split_seed`` shuffles the
pairs, the run's seed does not) is the eval set and never drawn for training. ``held_out: 0`` trains on
every pair and evaluates on every pair (nothing held out; the task as it was before the split existed).

Options that change what is asked and what is paid, all off by default:
- ``max_digit`` d < 9: an operand is a number <= ``max_operand`` whose every digit is <= d (``max_operand: 44,
  max_digit: 4``: 25 two-digit operands whose sums never carry, so each digit of the answer is the sum of the
  operands' digits in its column). A held-out problem is then a new combination of column sums the training
  problems hold.
- ``max_b`` m < ``max_operand``: the second operand is at most m (``max_operand: 44, max_digit: 4, max_b: 4``:
  a two-digit number plus a digit; the tens digit of the answer is that of ``a``).
- ``operand_width`` w >= 2: operands zero-padded to w digits in the prompt (``03+41=``), so digits of one column
  sit at fixed offsets.
- ``answer_width`` w >= 2: the answer is the sum zero-padded to w digits (``3+4=`` -> ``07``), so every answer
  is exactly w byte tokens and no answer has to be ended by a newline. 0: the sum as written (``7``).
- ``partial_credit``: a wrong answer is paid the share of the expected answer's characters it has right, in
  place (``17`` for ``07``: 0.5; a longer answer divides by its own length). An exact answer is still the only
  one paid 1.0, so held-out accuracy and pass@k (``eval.correct_reward: 1.0``) count exact answers only.
"""
from __future__ import annotations

import functools
import math
import random
import string
from typing import Callable, Optional

from glm5_core.rl.rollout.envs.base import Environment, Episode, TurnLimits
from glm5_core.rl.rollout.envs.chat_prompts import model_text, prompt_tokens, stop_tokens
from glm5_core.rl.rollout.envs.codec import ByteCodec
from glm5_core.rl.rollout.envs.rng_state import load_rng_state, rng_state_dict

MAX_SPLIT_PAIRS = 1 << 16  # held-out splits list every (a, b) pair: max_operand <= 255


def score_answer(text: str, expected: int) -> float:
    return 1.0 if text.split("\n", 1)[0].strip() == str(expected) else 0.0


def expected_answer(total: int, answer_width: int) -> str:
    """The answer text of a sum: as written (``answer_width`` 0) or zero-padded to ``answer_width`` digits."""
    return str(total).zfill(answer_width)


def score_text(text: str, expected: str, partial_credit: bool) -> float:
    """1.0 iff the first line of ``text`` (spaces stripped) is ``expected``; else 0.0, or with ``partial_credit``
    the share of characters right in place, over the longer of the two."""
    got = text.split("\n", 1)[0].strip()
    if got == expected:
        return 1.0
    if not partial_credit or not got:
        return 0.0
    right = sum(g == e for g, e in zip(got, expected))
    return right / max(len(got), len(expected))


def _check_template(template: str) -> None:
    """Only plain ``{a}`` and ``{b}`` fields: a format spec (``{a:900000000}`` pads to 900 MB), a conversion or an
    attribute / index lookup is refused (``operand_width`` pads the operands)."""
    expected = f"template: expected no placeholder but {{a}} and {{b}} (literal braces doubled), got {template!r:.120}"
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as exc:  # an unmatched brace
        raise ValueError(f"{expected} (ValueError: {exc})") from None
    for name, spec, conversion in fields:
        if name not in ("a", "b") or spec or conversion is not None:
            text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            padding = " (operand_width pads the operands)" if name in ("a", "b") else ""
            raise ValueError(f"{expected} (a field {text[:40]}{padding})")


class ArithmeticEpisode(Episode):
    def __init__(self, group_id: str, a: int, b: int, codec: ByteCodec, template: str, max_new_tokens: int,
                 answer_width: int = 0, partial_credit: bool = False, operand_width: int = 0):
        self.group_id = group_id
        self.a, self.b = a, b
        self.expected = expected_answer(a + b, answer_width)
        self._partial_credit = partial_credit
        self._codec = codec
        text = template.format(a=str(a).zfill(operand_width), b=str(b).zfill(operand_width))
        self._prompt = prompt_tokens(codec, text)  # bytes, or the chat template's user turn
        self._limits = TurnLimits(max_new_tokens, stop_tokens(codec, "\n"))
        self._answer: list[int] = []
        self._turns = 0

    def context_tokens(self) -> list[int]:
        return list(self._prompt)

    def turn_limits(self) -> TurnLimits:
        return self._limits

    def observe(self, output_ids: list[int]) -> bool:
        self._answer = list(output_ids)
        self._turns += 1
        return True

    @property
    def reward(self) -> float:
        return score_text(model_text(self._codec, self._answer), self.expected, self._partial_credit)

    @property
    def num_turns(self) -> int:
        return self._turns

    def info(self) -> dict[str, float]:
        return {"answer_len": float(len(self._answer))}


class ArithmeticEnv(Environment):
    def __init__(self, *, max_operand: int = 4, template: str = "{a}+{b}=", max_new_tokens: int = 3,
                 held_out: float = 0.2, split_seed: int = 0, answer_width: int = 0, partial_credit: bool = False,
                 max_digit: int = 9, max_b: Optional[int] = None, operand_width: int = 0, codec: ByteCodec = None,
                 seed: int = 0):
        if not isinstance(max_operand, int) or not 0 <= max_operand <= 10**6:
            raise ValueError(f"max_operand: expected an int in [0, 1e6], got {max_operand!r}")
        if "{a}" not in template or "{b}" not in template:
            raise ValueError(f"template: expected placeholders {{a}} and {{b}}, got {template!r}")
        _check_template(template)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        if isinstance(held_out, bool) or not isinstance(held_out, (int, float)) or not 0.0 <= held_out < 1.0:
            raise ValueError(f"held_out: expected a share in [0, 1) of the (a, b) pairs, got {held_out!r}")
        if isinstance(split_seed, bool) or not isinstance(split_seed, int):
            raise ValueError(f"split_seed: expected an int, got {split_seed!r}")
        if isinstance(max_digit, bool) or not isinstance(max_digit, int) or not 0 <= max_digit <= 9:
            raise ValueError(f"max_digit: expected an int in [0, 9], got {max_digit!r}")
        if max_digit < 9 and max_operand <= max_digit:
            raise ValueError(f"max_digit: expected 9 (every operand) or a digit below max_operand={max_operand} "
                             f"(no operand up to {max_operand} has a digit above {max_digit}), got {max_digit!r}")
        # the operands (None: every int in [0, max_operand]); max_operand 1e6 lists at most 1e6 ints
        self._numbers = None if max_digit == 9 else [n for n in range(max_operand + 1)
                                                     if max(str(n)) <= str(max_digit)]
        if max_b is not None and (isinstance(max_b, bool) or not isinstance(max_b, int)
                                  or not 0 <= max_b < max_operand):
            raise ValueError(f"max_b: expected null (b up to max_operand) or an int in [0, max_operand={max_operand}), "
                             f"got {max_b!r}")
        # the second operands (None: the same as the first)
        self._b_numbers = None if max_b is None else (list(range(max_b + 1)) if self._numbers is None
                                                      else [n for n in self._numbers if n <= max_b])
        if self._b_numbers is not None and self._numbers is not None and self._b_numbers == self._numbers:
            raise ValueError(f"max_b: expected null or a bound below the largest operand {self._numbers[-1]} "
                             f"(with max_digit={max_digit} it bounds nothing), got {max_b!r}")
        n_numbers = max_operand + 1 if self._numbers is None else len(self._numbers)
        n_pairs = n_numbers * (n_numbers if self._b_numbers is None else len(self._b_numbers))
        if held_out > 0 and n_pairs < 2:
            raise ValueError(f"held_out: expected 0 with max_operand=0 (one pair: nothing left to train on), "
                             f"got {held_out!r}")
        if held_out > 0 and n_pairs > MAX_SPLIT_PAIRS:
            raise ValueError(f"held_out: expected 0 with max_operand > {math.isqrt(MAX_SPLIT_PAIRS) - 1} (the split "
                             f"lists every pair), got {held_out!r} with max_operand={max_operand} "
                             f"({n_numbers} operands, {n_pairs} pairs)")
        self._n_pairs = n_pairs
        largest = max_operand if self._numbers is None else self._numbers[-1]
        widest = len(str(largest + (largest if max_b is None else max_b)))
        if isinstance(answer_width, bool) or not isinstance(answer_width, int) or not (
                answer_width == 0 or answer_width >= max(2, widest)):
            raise ValueError(f"answer_width: expected 0 (the sum as written) or an int >= {max(2, widest)} (every sum "
                             f"zero-padded to one width: 1 pads nothing, and the widest sum with "
                             f"max_operand={max_operand} has {widest} digits), got {answer_width!r}")
        if answer_width and max_new_tokens < answer_width:
            raise ValueError(f"max_new_tokens: expected >= answer_width={answer_width} (no answer fits otherwise), "
                             f"got {max_new_tokens!r}")
        if isinstance(operand_width, bool) or not isinstance(operand_width, int) or not (
                operand_width == 0 or operand_width >= max(2, len(str(largest)))):
            raise ValueError(f"operand_width: expected 0 (operands as written) or an int >= "
                             f"{max(2, len(str(largest)))} (1 pads nothing; the largest operand, {largest}, has "
                             f"{len(str(largest))} digits), got {operand_width!r}")
        self.max_digit, self.operand_width = max_digit, operand_width
        if not isinstance(partial_credit, bool):
            raise ValueError(f"partial_credit: expected true or false, got {partial_credit!r}")
        self.answer_width = answer_width
        self.partial_credit = partial_credit
        self.max_operand = max_operand
        self.template = template
        self.max_new_tokens = max_new_tokens
        self.held_out = float(held_out)
        self.codec = codec or ByteCodec()
        self._rng = random.Random(seed)
        self._train, self._eval = self._split(split_seed)

    def state_dict(self) -> dict:
        return rng_state_dict(self._rng)

    def load_state_dict(self, state: dict) -> None:
        load_rng_state(self._rng, state)

    def problems(self) -> list[tuple[int, int]]:
        """Every (a, b) of the task."""
        numbers = range(self.max_operand + 1) if self._numbers is None else self._numbers
        return [(a, b) for a in numbers for b in (numbers if self._b_numbers is None else self._b_numbers)]

    def _split(self, split_seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(training pairs, held-out pairs): at least one of each when ``held_out`` > 0."""
        if self.held_out == 0:  # nothing held out: the eval set is every pair (listed only if it is small)
            pairs = self.problems() if self._n_pairs <= MAX_SPLIT_PAIRS else []
            return pairs, pairs
        pairs = self.problems()
        shuffled = list(pairs)
        random.Random(split_seed).shuffle(shuffled)
        n_eval = min(len(pairs) - 1, max(1, round(self.held_out * len(pairs))))
        return sorted(shuffled[n_eval:]), sorted(shuffled[:n_eval])

    def train_problems(self) -> list[tuple[int, int]]:
        return list(self._train)

    def eval_problems(self) -> list[tuple[int, int]]:
        """The held-out pairs (every pair with ``held_out`` 0)."""
        return list(self._eval)

    def episode(self, group_id: str, a: int, b: int) -> ArithmeticEpisode:
        return ArithmeticEpisode(group_id, a, b, self.codec, self.template, self.max_new_tokens, self.answer_width,
                                 self.partial_credit, self.operand_width)

    def eval_set(self) -> Optional[list[Callable[[str], Episode]]]:
        """One episode factory per held-out pair; None when there are too many pairs to list."""
        return [functools.partial(self._eval_episode, a, b) for a, b in self._eval] or None

    def _eval_episode(self, a: int, b: int, group_id: str) -> ArithmeticEpisode:
        return self.episode(group_id, a, b)

    def new_group(self, group_id: str, group_size: int) -> list[Episode]:
        if self.held_out == 0 and (self._numbers is not None or self._b_numbers is not None):  # listed operands
            a = self._rng.choice(self._numbers) if self._numbers is not None else self._rng.randint(0, self.max_operand)
            b = self._rng.choice(self._b_numbers if self._b_numbers is not None else self._numbers)
        elif self.held_out == 0:  # every pair: two draws, as before the split existed
            a = self._rng.randint(0, self.max_operand)
            b = self._rng.randint(0, self.max_operand)
        else:
            a, b = self._train[self._rng.randrange(len(self._train))]
        return [self.episode(group_id, a, b) for _ in range(group_size)]
