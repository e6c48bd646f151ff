"""The token codec of a ``glm5 rl`` run's environments: the byte codec (default) or ``rollout.tokenizer``.

``rollout.tokenizer`` names a Hugging Face tokenizer directory with a chat template (see
:mod:`glm5_core.rl.rollout.tokenizer`). The environments then encode their text (prompts, tool results) and decode
the engine's completions through it; the tokens the engine sampled reach the trainer as sampled (the TITO gateway
records them), never re-tokenised. Checked at start, each problem one line naming the key: the directory loads,
has a chat template, and its vocabulary fits the policy's ``vocab_size``.
"""
from __future__ import annotations

from typing import Optional

TOKENIZER_KEY = "rollout.tokenizer"


def load_run_tokenizer(path: str, key: str = TOKENIZER_KEY):
    """The :class:`~glm5_core.rl.rollout.tokenizer.ChatTokenizer` of directory ``path``; ValueError (naming
    ``key``) when it does not load or has no chat template."""
    from glm5_core.rl.rollout.tokenizer import load_chat_tokenizer

    try:
        tokenizer = load_chat_tokenizer(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{key}: {exc}") from None
    except ImportError as exc:  # tokenizers / transformers: the [agents] extra
        raise ValueError(f"{key}: needs pip install 'glm5-core[agents]' ({exc})") from None
    if not tokenizer.has_chat_template:
        raise ValueError(f"{key}: expected a tokenizer directory with a chat template (chat_template in "
                         f"tokenizer_config.json or chat_template.jinja), {path!r} has none")
    return tokenizer


def vocab_problem(codec, vocab_size: int, key: str) -> Optional[str]:
    """The problem of a policy with ``vocab_size`` ids reading ``codec``'s tokens (None: it fits)."""
    if codec.min_vocab_size <= vocab_size:
        return None
    what = "the tokenizer has" if key == TOKENIZER_KEY else "byte tokens need"
    return (f"{key}: {what} {codec.min_vocab_size} token ids, more than the policy's vocab_size={vocab_size} "
            f"(model.overrides.vocab_size or the checkpoint's config.json)")


def run_codec(tokenizer_path: Optional[str], byte_offset: int = 0):
    """The environments' codec: the tokenizer at ``tokenizer_path``, else the byte codec at ``byte_offset``."""
    if tokenizer_path is not None:
        return load_run_tokenizer(tokenizer_path)
    from glm5_core.rl.rollout.envs.codec import ByteCodec

    return ByteCodec(byte_offset)
