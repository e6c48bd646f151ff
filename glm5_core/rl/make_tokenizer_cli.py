"""``glm5 make-tokenizer DIR``: write a small byte-level BPE chat tokenizer directory (ChatML or GLM-4 chat template,
Hermes-style tool calls) for trying agents, ``glm5 proxy`` and ``env: {name: openai_agent}`` without a real model's
tokenizer (``glm5_core/rl/rollout/chat_tokenizer_builder.py``). It prints the vocabulary size a policy needs
(``--set model.overrides.vocab_size=N``).
"""
from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from glm5_core.rl.rollout.chat_tokenizer_builder import STYLES

    parser.add_argument("directory", help="where to write tokenizer.json and tokenizer_config.json (created)")
    parser.add_argument("--style", default="chatml", choices=STYLES, help="chat template (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=400,
                        help="BPE vocabulary before the tool tokens (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace the files of an existing tokenizer directory")


def run(args: argparse.Namespace) -> int:
    from glm5_core.rl.rollout.chat_tokenizer_builder import build_tokenizer_dir, tokenizer_vocab_size

    if os.path.exists(os.path.join(args.directory, "tokenizer.json")) and not args.force:
        raise ValueError(f"directory: {args.directory} already holds a tokenizer; pass --force to replace it")
    build_tokenizer_dir(args.directory, style=args.style, vocab_size=args.vocab_size)
    n = tokenizer_vocab_size(args.directory)
    print(f"glm5 make-tokenizer: wrote {args.directory} ({args.style}, {n} tokens: a policy needs "
          f"--set model.overrides.vocab_size={n} or more)")
    return 0
