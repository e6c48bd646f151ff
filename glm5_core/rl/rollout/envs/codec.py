"""Byte-level text <-> token ids, matching a byte-level pretraining tokenizer (id = byte + offset).

Environments use it to turn their own text (prompts, tool results) into tokens once; model outputs are
never re-encoded (TITO): they are decoded only to compute rewards and tool calls.
"""
from __future__ import annotations

from collections.abc import Sequence


class ByteCodec:
    def __init__(self, offset: int = 0):
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"byte_offset: expected an int >= 0, got {offset!r}")
        self.offset = offset

    @property
    def min_vocab_size(self) -> int:
        return self.offset + 256

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids outside the byte range (special tokens) are skipped; invalid UTF-8 becomes U+FFFD."""
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    def token(self, char: str) -> int:
        ids = self.encode(char)
        if len(ids) != 1:
            raise ValueError(f"char: expected one byte, got {char!r}")
        return ids[0]
