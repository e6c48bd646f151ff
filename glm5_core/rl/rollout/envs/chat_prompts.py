"""How the built-in environments turn their text into context tokens: as bytes, or through a chat template.

With the byte codec (the default) a prompt is its text's bytes and a tool reply is appended as bytes, as always.
With ``rollout.tokenizer`` (a :class:`~glm5_core.rl.rollout.tokenizer.ChatTokenizer` with a chat template) the
prompt is the template's rendering of one user message with the generation prompt, and each later turn appends
the template's ids for the messages that follow the model's answer (a ``role: tool`` result, a user message)
through the next generation prompt: :class:`ChatTurns`, on the proxy's :class:`ChatTranscript`, so the sampled ids
stay as sampled and only the environment's messages are encoded. Generation then stops on the tokenizer's
end-of-turn ids (not on the byte environments' newline), and answers are read without leading whitespace.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from glm5_core.rl.rollout.chat_transcript import ChatTranscript

Message = dict[str, Any]


def uses_chat_template(codec: Any) -> bool:
    """Whether ``codec`` is a tokenizer with a chat template (else: the byte codec, plain text)."""
    return bool(getattr(codec, "has_chat_template", False))


def prompt_tokens(codec: Any, text: str) -> list[int]:
    """The first context: ``text`` as bytes, or as the user message of the chat template with its generation
    prompt."""
    if not uses_chat_template(codec):
        return codec.encode(text)
    return codec.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def stop_tokens(codec: Any, *texts: str) -> tuple[int, ...]:
    """Token ids generation stops on: with bytes, each of ``texts`` (one token each); with a chat template, the
    tokenizer's end-of-turn ids instead (a template may open the answer with a newline, as GLM's does)."""
    if uses_chat_template(codec):
        return tuple(codec.stop_token_ids)
    return tuple(codec.token(t) for t in texts)


def model_text(codec: Any, output_ids: Sequence[int]) -> str:
    """The text of the model's answer: its bytes as decoded; through a chat template without special tokens and
    without the whitespace it may open with (GLM's answers start on a new line)."""
    text = codec.decode(output_ids)
    return text.lstrip() if uses_chat_template(codec) else text


class ChatTurns:
    """The chat record of one multi-turn episode: :attr:`prompt` first, then per turn :meth:`reply` with the
    model's sampled ids and the environment's messages gives the ids to append after the sampled ids."""

    def __init__(self, tokenizer, user_text: str):
        self.tokenizer = tokenizer
        self._transcript = ChatTranscript(tokenizer)
        self._messages: list[Message] = [{"role": "user", "content": user_text}]
        self.prompt: list[int] = self._transcript.prompt_ids(self._messages)
        self._ids = list(self.prompt)  # the whole conversation's ids up to the next generation

    def _recorded(self, output_ids: Sequence[int]) -> None:
        """Record the model's turn (its text, for the template; its ids, as sampled)."""
        stops = self.tokenizer.stop_token_ids
        stop = output_ids[-1] if output_ids and output_ids[-1] in stops else None
        content = self.tokenizer.decode(output_ids[:-1] if stop is not None else output_ids)
        self._transcript.record(self._messages, None, self._ids, {"role": "assistant", "content": content},
                                list(output_ids), None if stop is None else self.tokenizer.token_text(stop))

    def _appended(self, messages: list[Message]) -> list[int]:
        ids = self._transcript.prompt_ids(self._transcript.messages + messages)
        recorded = self._transcript.tokens
        if ids[:len(recorded)] != recorded:
            raise ValueError("chat template: not append-only for the environment's messages (the rendering of the "
                             "conversation so far changed); the built-in environments need one that is")
        return ids[len(recorded):]

    def reply(self, output_ids: Sequence[int], messages: list[Message],
              folded: Optional[list[Message]] = None) -> tuple[list[int], Optional[list[int]]]:
        """After the model sampled ``output_ids``: the ids of ``messages`` (closing the model's turn, through the
        next generation prompt), and those of ``folded`` (the same turn with a shortened tool result) if given."""
        self._recorded(output_ids)
        ids = self._appended(messages)
        folded_ids = self._appended(folded) if folded is not None else None
        self._messages = self._transcript.messages + messages
        self._ids = self._transcript.tokens + ids
        return ids, folded_ids
