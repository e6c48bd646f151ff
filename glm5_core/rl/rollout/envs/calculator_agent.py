"""An example agent for ``env: {name: openai_agent}``: the calculator task as an OpenAI tool-calling loop.

``calculator_task(rng)`` draws 1 to 3 numbers in [0, 9]. ``calculator_agent(client, model, task)`` is written
against the ``openai`` package only (nothing of glm5-core's serving): it reveals the numbers one per user turn, offers
a ``calc`` tool in OpenAI's format, answers the model's tool calls with :func:`calculate` results as ``role: tool``
messages, asks for the answer after the last number, and returns 1.0 when the answer's first line is the total,
else 0.0. See ``configs/rl_openai_agent.yaml``.
"""
from __future__ import annotations

import json
import random
from typing import Any

from glm5_core.rl.rollout.envs.arithmetic import score_answer
from glm5_core.rl.rollout.envs.calculator_tool import ToolError, calculate

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an integer expression such as 3+4*2",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SYSTEM = "Add the numbers with calc. Answer with the total only."


def calculator_task(rng: random.Random) -> dict[str, list[int]]:
    """One task: the numbers to add."""
    return {"numbers": [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]}


def tool_result(call) -> str:
    """What the calc tool answers to one OpenAI tool call (an error message for a bad call)."""
    if call.function.name != "calc":
        return f"error: unknown tool {call.function.name!r}"
    try:
        return str(calculate(str(json.loads(call.function.arguments)["expression"])))
    except (ToolError, ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def calculator_agent(client: Any, model: str, task: dict[str, list[int]]) -> float:
    """Play one task with ``client`` (an ``openai.OpenAI``); the reward."""
    numbers = task["numbers"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"First: {numbers[0]}"}]
    revealed = 0
    while True:
        revealed += 1
        completion = client.chat.completions.create(model=model, messages=messages, tools=[CALC_TOOL])
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if revealed > len(numbers):  # this turn was the answer
            return score_answer(message.content or "", sum(numbers))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(call)})
        messages.append({"role": "user", "content": f"Next: {numbers[revealed]}" if revealed < len(numbers)
                         else "answer:"})
