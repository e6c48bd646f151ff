"""One trajectory's conversation as token ids, built by appending (token-in-token-out across turns).

What the engine sampled is kept as sampled and never re-tokenised. When the next request's messages extend the
recorded conversation (the same messages, then the assistant message this trajectory was answered with, then new
ones), its prompt is the recorded ids followed by the ids of what the chat template writes for the new messages:

    new text = render(messages + new, generation prompt) - render(messages)     (a suffix, by the check below)

encoded once (:meth:`ChatTokenizer.encode_rendered`). Between the sampled tokens and the new text goes what the
template writes after the assistant's end-of-turn token (``turn`` below: the template's rendering of the last
assistant message):

* the engine stopped on a stop token that the template writes at the end of the turn (ChatML's ``<|im_end|>``):
  the template's text after it (Qwen's ``"\\n"``; nothing in Phi-4's layout);
* it stopped on a stop token that the template writes at the start of the next message instead (GLM ends a turn
  on ``<|observation|>`` / ``<|user|>``): that token was sampled, so the new text goes on after it;
* it was cut (``length``): the end-of-turn token and what follows it are appended as context, as the template
  would close the turn.

Every piece boundary sits next to a control token in a template where each message opens with a role token and
the generation prompt ends with one (``<|im_sep|>``, ``<|assistant|>``), so byte-level BPE cannot merge across it and
the appended ids equal the template's ids of the whole conversation wherever the model's tokens equal the
canonical tokenisation of its text. They legitimately differ where the model sampled a non-canonical
tokenisation, or where the template renders an assistant message differently from what the model wrote (e.g. it
re-serialises tool-call JSON): there the record keeps what was sampled, which is what the policy must train on.

A request that does not extend the record (the agent rewrote history, changed tools), or a template that is not
append-only (its rendering of the known messages is not a prefix of the new one, e.g. one that drops earlier
reasoning), is rendered whole; the gateway then opens a new sample (``rerenders`` counts these).
"""
from __future__ import annotations

from typing import Any, Optional

from glm5_core.rl.rollout.tokenizer import ChatTokenizer

Message = dict[str, Any]


class ChatTranscript:
    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer
        self.messages: list[Message] = []  # ends with the assistant message of the last sampled turn
        self.tools: Optional[list[dict]] = None
        self.tokens: list[int] = []  # recorded ids of ``messages``: context and sampled tokens
        self.stop_text: Optional[str] = None  # the stop token that ended the last sampled turn (None: cut)
        self.rerenders = 0

    def prompt_ids(self, messages: list[Message], tools: Optional[list[dict]] = None) -> list[int]:
        """Ids of the prompt for ``messages`` (ending with the generation prompt)."""
        ids = self._appended(messages, tools) if self._extends(messages, tools) else None
        if ids is None:
            if self.messages:
                self.rerenders += 1
            ids = self.tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True)
        return ids

    def record(self, messages: list[Message], tools: Optional[list[dict]], prompt_ids: list[int],
               assistant: Message, output_ids: list[int], stop_text: Optional[str]) -> None:
        """The engine answered ``prompt_ids`` (from :meth:`prompt_ids` of ``messages``) with ``output_ids``,
        returned to the agent as ``assistant``; ``stop_text`` is the stop token it ended on (None when cut)."""
        self.messages = [*messages, assistant]
        self.tools = tools
        self.tokens = [*prompt_ids, *output_ids]
        self.stop_text = stop_text

    def _extends(self, messages: list[Message], tools: Optional[list[dict]]) -> bool:
        n = len(self.messages)
        return 0 < n < len(messages) and tools == self.tools and messages[:n] == self.messages

    def _appended(self, messages: list[Message], tools: Optional[list[dict]]) -> Optional[list[int]]:
        render = self.tokenizer.render
        head = render(self.messages[:-1], tools, add_generation_prompt=True)
        before = render(self.messages, tools)
        after = render(messages, tools, add_generation_prompt=True)
        if not (before.startswith(head) and after.startswith(before)):
            return None  # the template is not append-only here
        turn, new = before[len(head):], after[len(before):]
        return self.tokens + self.tokenizer.encode_rendered(self._between(turn, new))

    def _between(self, turn: str, new: str) -> str:
        """Template text from just after the sampled tokens to the end of the next generation prompt."""
        stop = self.stop_text
        if stop is not None:
            end = turn.rfind(stop)
            if end >= 0:
                return turn[end + len(stop):] + new  # what follows the end-of-turn token
            if new.startswith(stop):
                return new[len(stop):]  # the sampled stop token opened the next message (GLM)
            return new
        end = max((turn.rfind(t) for t in self.tokenizer.stop_texts().values()), default=-1)
        return (turn[end:] if end >= 0 else "") + new  # cut: closed with its end-of-turn token, as the template
