"""Chat tokenizers: a Hugging Face tokenizer directory with a chat template, beside the byte codec.

The directory (the ``tokenizer:`` setting) holds:

* ``tokenizer.json``: the ``tokenizers`` pipeline (vocabulary, merges, added tokens);
* ``tokenizer_config.json``: special tokens (``eos_token``, ...) and, in the older layout, the Jinja ``chat_template``
  (a string, or a list of ``{"name", "template"}`` of which ``default`` is used);
* ``chat_template.jinja`` (newer layout; preferred when present), optional;
* ``generation_config.json`` (``eos_token_id``: an id or the list of ids that end an assistant turn), optional.

The files come from disk and are untrusted: sizes are checked before reading, JSON is parsed by us, the tokenizer is
built from the checked text (``PreTrainedTokenizerFast(tokenizer_object=...)``: no code named in the files is ever
imported) and the template is rendered by transformers' sandboxed Jinja environment.

:class:`ChatTokenizer` offers the byte codec's interface (``encode``, ``decode``, ``token``, ``min_vocab_size``), so an
environment written against :class:`~glm5_core.rl.rollout.envs.codec.ByteCodec` takes it as its ``codec``, and chat
rendering (``render``, ``encode_rendered``, ``apply_chat_template``).

Control tokens: every added token (``<|im_end|>``, ``<tool_call>``, ...) in a message, tool schema or tool result is
text written by a client, a tool or the model, not structure. :meth:`ChatTokenizer.render` wraps each occurrence of
one in private-use markers (U+E000 / U+E001; those characters are dropped from input strings first, so input cannot
forge a marked token), and :meth:`ChatTokenizer.encode_rendered` encodes a marked token as plain text, so only the
template's own control tokens become control-token ids (as transformers' ``sanitize_control_tokens``). A tool result
holding ``<|im_end|>`` therefore cannot end its turn early.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any, Optional

MAX_TOKENIZER_JSON_BYTES = 64 << 20
MAX_CONFIG_BYTES = 4 << 20  # tokenizer_config.json (it may embed a chat template), generation_config.json
MAX_TEMPLATE_BYTES = 1 << 20
MAX_VOCAB_SIZE = 1 << 22

MARK_START, MARK_END = "\ue000", "\ue001"
_MARKED_OR_LONE = re.compile(f"{MARK_START}([^{MARK_START}{MARK_END}]*){MARK_END}|[{MARK_START}{MARK_END}]")


def _read_text(path: str, limit: int) -> str:
    size = os.path.getsize(path)
    if size > limit:
        raise ValueError(f"tokenizer: {path} is {size} bytes, expected at most {limit}")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"tokenizer: {path} is not UTF-8 text ({exc})") from None


def _read_json_object(path: str, limit: int) -> dict[str, Any]:
    try:
        value = json.loads(_read_text(path, limit))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"tokenizer: {path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"tokenizer: {path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(config: dict[str, Any], key: str) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with ``content``."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"tokenizer_config.json: {key}: expected a token string, got {type(value).__name__}")
    return value


def _chat_template(path: str, config: dict[str, Any]) -> Optional[str]:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        return _read_text(jinja, MAX_TEMPLATE_BYTES)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"tokenizer_config.json: chat_template: a list of named templates needs one named "
                             f"'default', got names {sorted(map(str, named))}")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"tokenizer_config.json: chat_template: expected a Jinja string, "
                         f"got {type(template).__name__}")
    if template is not None and len(template.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"tokenizer_config.json: chat_template: expected at most {MAX_TEMPLATE_BYTES} bytes")
    return template


def _generation_eos_ids(path: str, vocab_size: int) -> list[int]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return []
    value = _read_json_object(file, MAX_CONFIG_BYTES).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ValueError(f"generation_config.json: eos_token_id: expected token ids in [0, {vocab_size}), "
                             f"got {value!r:.80}")
    return list(ids)


def mark_control_tokens(obj: Any, pattern: re.Pattern) -> Any:
    """Copy of ``obj`` (str / list / dict values, recursively; keys kept) with control tokens wrapped in markers."""
    if isinstance(obj, str):
        obj = obj.replace(MARK_START, "").replace(MARK_END, "")
        return pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, obj)
    if isinstance(obj, dict):
        return {k: mark_control_tokens(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mark_control_tokens(v, pattern) for v in obj]
    return obj


def unmark(text: str) -> str:
    return text.replace(MARK_START, "").replace(MARK_END, "")


class ChatTokenizer:
    """A loaded tokenizer directory (see the module docstring); build with :func:`load_chat_tokenizer`."""

    def __init__(self, hf_tokenizer, plain_tokenizer, *, chat_template: Optional[str], stop_token_ids: Sequence[int],
                 source: str = "<memory>"):
        self.hf = hf_tokenizer  # transformers PreTrainedTokenizerFast: chat-template rendering
        # encoding and decoding go straight to the tokenizers pipeline: thread-safe, and no text clean-up on decode
        self._backend = hf_tokenizer.backend_tokenizer
        self._plain = plain_tokenizer  # the same pipeline without added tokens: control tokens as plain text
        self.chat_template = chat_template
        self.source = source
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in stop_token_ids))
        self.control_tokens: dict[str, int] = dict(hf_tokenizer.added_tokens_encoder)
        self._control_ids = frozenset(self.control_tokens.values())
        self._stop_texts = {i: self.token_text(i) for i in self.stop_token_ids}
        longest_first = sorted(self.control_tokens, key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!) matches nothing

    # -- the byte codec's interface --------------------------------------------------------------------------
    @property
    def min_vocab_size(self) -> int:
        """The model's vocabulary must hold at least this many ids."""
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids: a control token's text in ``text`` is encoded as text, never as the control token."""
        ids = self._plain.encode(text, add_special_tokens=False).ids
        control = self._control_ids.intersection(ids)
        if control:  # the vocabulary's merges rebuild a control token from plain text: it cannot be kept as text
            names = sorted(self._backend.id_to_token(i) for i in control)
            raise ValueError(f"text: the tokenizer produces control tokens {names} from plain text {text!r:.80}")
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def encode_with_control_tokens(self, text: str) -> list[int]:
        """Text written in the template's own format (a raw completion prompt): control tokens become their ids."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def token(self, text: str) -> int:
        """The id of ``text`` when it is exactly one token (a control token's text gives the control token)."""
        ids = self.encode_with_control_tokens(text)
        if len(ids) != 1:
            raise ValueError(f"text: expected one token, got {text!r} as {len(ids)} tokens")
        return ids[0]

    def token_text(self, token_id: int) -> str:
        """Text of one token, special tokens included (a byte of a multi-byte character decodes to U+FFFD)."""
        return self._backend.decode([int(token_id)], skip_special_tokens=False)

    # -- chat rendering ----------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None, *,
               add_generation_prompt: bool = False) -> str:
        """The chat template's text for ``messages``, control tokens from the inputs marked (see the module doc)."""
        if self.chat_template is None:
            raise ValueError(f"tokenizer: {self.source} has no chat template (chat_template in tokenizer_config.json "
                             "or chat_template.jinja)")
        return self.hf.apply_chat_template(
            mark_control_tokens(messages, self._control_re), tools=mark_control_tokens(tools, self._control_re),
            chat_template=self.chat_template, add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of text from :meth:`render` (or a piece of it): the template's control tokens as control-token ids,
        marked ones as plain text. A lone marker (a template string method split a pair) is dropped, but still
        separates the text on either side."""
        pieces = _MARKED_OR_LONE.split(text)  # [text, marked, text, marked, ..., text]; None for a lone marker
        ids = self.encode_with_control_tokens(pieces[0]) if pieces[0] else []
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            ids += self.encode(piece) if i % 2 == 1 else self.encode_with_control_tokens(piece)
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None, *,
                            add_generation_prompt: bool = False) -> list[int]:
        """Ids of the whole conversation rendered at once."""
        return self.encode_rendered(self.render(messages, tools, add_generation_prompt=add_generation_prompt))

    def stop_texts(self) -> dict[int, str]:
        """Text of each end-of-turn token."""
        return dict(self._stop_texts)


def load_chat_tokenizer(path: str, *, stop_tokens: Optional[Sequence[str]] = None) -> ChatTokenizer:
    """Load the tokenizer directory ``path``. ``stop_tokens`` (token strings) end an assistant turn; by default the
    ids of ``generation_config.json``'s ``eos_token_id``, else ``tokenizer_config.json``'s ``eos_token``."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"tokenizer: expected a directory holding tokenizer.json, got {path!r}")
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ValueError(f"tokenizer: {path} has no tokenizer.json (only the fast tokenizers format is supported)")
    config_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json_object(config_file, MAX_CONFIG_BYTES) if os.path.isfile(config_file) else {}
    text = _read_text(tokenizer_file, MAX_TOKENIZER_JSON_BYTES)

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    try:
        pipeline = json.loads(text)
        if not isinstance(pipeline, dict):
            raise ValueError(f"expected a JSON object, got {type(pipeline).__name__}")
        backend = Tokenizer.from_str(text)
        plain = dict(pipeline, added_tokens=[])  # the same pipeline knowing no added token
        plain_backend = Tokenizer.from_str(json.dumps(plain))
    except Exception as exc:  # json's ValueError / RecursionError, or the tokenizers library's own Exception
        raise ValueError(f"tokenizer: {tokenizer_file} is not a tokenizers file ({type(exc).__name__}: {exc})") \
            from None
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"tokenizer: {tokenizer_file}: expected 1 to {MAX_VOCAB_SIZE} tokens, got {vocab_size}")
    specials = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        content = _token_content(config, key)
        if content:
            specials[key] = content
    template = _chat_template(path, config)
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **specials)

    if stop_tokens is not None:
        ids = []
        for t in stop_tokens:
            if not isinstance(t, str) or t not in hf.added_tokens_encoder:
                raise ValueError(f"stop_tokens: expected added tokens of {path}, got {t!r}")
            ids.append(hf.added_tokens_encoder[t])
    else:
        ids = _generation_eos_ids(path, len(hf)) or ([hf.eos_token_id] if hf.eos_token_id is not None else [])
    if not ids:
        raise ValueError(f"tokenizer: {path} names no end-of-turn token (eos_token in tokenizer_config.json or "
                         "eos_token_id in generation_config.json); pass stop_tokens")
    return ChatTokenizer(hf, plain_backend, chat_template=template, stop_token_ids=ids, source=path)
