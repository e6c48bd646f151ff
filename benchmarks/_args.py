"""Command-line argument types the benchmark scripts share (imported as ``_args`` from the scripts' folder)."""
from __future__ import annotations

import argparse
from typing import Callable


def batch_tokens(min_tokens: int = 1) -> Callable[[str], tuple[int, int]]:
    """An argparse ``type`` reading ``BATCHxTOKENS`` (e.g. ``2x512``): batch >= 1, tokens >= ``min_tokens``."""

    def parse(text: str) -> tuple[int, int]:
        try:
            batch, tokens = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"case: expected BATCHxTOKENS such as 2x512, got {text!r}") from None
        if batch < 1 or tokens < min_tokens:
            raise argparse.ArgumentTypeError(f"case: expected batch >= 1 and tokens >= {min_tokens}, got {text!r}")
        return batch, tokens

    return parse
