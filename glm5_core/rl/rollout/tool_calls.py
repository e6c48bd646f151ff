"""Tool calls in the model's text <-> OpenAI's ``tool_calls``.

The model writes a call as the chat template renders one (Hermes / Qwen style, the default):
``<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>``. :meth:`ToolCallParser.parse`
turns sampled text into the assistant message's ``content`` and OpenAI tool calls
``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``. A block that is not a JSON object
with a string ``name`` (1 to ``MAX_ID_CHARS`` characters: what a request's ``tool_calls`` may carry back) and object
``arguments`` is not a call: it stays in ``content`` as the model wrote it, so the agent sees it (and the trajectory
trains on it as sampled either way). An invalid call is the model's output, never the client's error.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Callable, Optional

from glm5_core.rl.rollout.openai_protocol import MAX_ID_CHARS


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>",
                 new_id: Callable[[], str] = new_call_id):
        if not open_tag or not close_tag:
            raise ValueError(f"open_tag / close_tag: expected non-empty strings, got {open_tag!r}, {close_tag!r}")
        self.open_tag, self.close_tag = open_tag, close_tag
        self._blocks = re.compile(re.escape(open_tag) + "(.*?)" + re.escape(close_tag), re.DOTALL)
        self._new_id = new_id

    @staticmethod
    def _call(block: str) -> Optional[tuple[str, dict]]:
        try:
            value = json.loads(block)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        name, arguments = value["name"], value["arguments"]
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_ID_CHARS or not isinstance(arguments, dict):
            return None
        return name, arguments

    def parse(self, text: str) -> tuple[Optional[str], list[dict]]:
        """``(content, tool_calls)`` of sampled text. Without a valid call, ``content`` is ``text`` unchanged;
        with calls it is the text around them, stripped (``None`` when nothing is left)."""
        calls: list[dict] = []
        kept: list[str] = []
        position = 0
        for match in self._blocks.finditer(text):
            call = self._call(match.group(1))
            if call is None:
                continue
            kept.append(text[position:match.start()])
            position = match.end()
            name, arguments = call
            calls.append({"id": self._new_id(), "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        if not calls:
            return text, []
        kept.append(text[position:])
        content = "".join(kept).strip()
        return (content or None), calls
