"""Corpora, tokenizers and deterministic packing into fixed-length sequences with a resumable position.

Corpus: an indexable list of documents (bytes), in a fixed order:
  * ``stdlib``: the Python standard library's own ``.py`` files (present everywhere, no download), sorted by
    path relative to ``sysconfig.get_paths()['stdlib']`` (third-party ``site-packages`` excluded);
  * a user path: one ``.jsonl`` file (one document per line, text under ``text_key``), one text file (one
    document), or a folder (every file with an allowed extension, sorted by relative path; a ``.jsonl``
    file there gives one document per line, as on its own).
Tokens: each document is encoded and followed by an end-of-document token; documents are concatenated into
one stream that wraps around (epochs), in corpus order or (``shuffle``) in a permutation of it drawn from
Python's ``random.Random`` seeded by (seed, epoch), so every machine reads the same order.
A batch is ``B`` rows of ``T + 1`` tokens cut from the stream in order, row ``i`` starting ``i * T`` after
the batch start (inputs ``row[:-1]``, labels ``row[1:]``), and the stream advances by ``B * T``. The position
(epoch, document, offset) after each batch is all a resumed run
needs to continue with the same batches.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

# ------------------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; token 256 ends a document."""

    vocab_size = 257
    eos_id = 256
    name = "byte"

    def encode(self, doc: bytes) -> list[int]:
        return list(doc) + [self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: str, eos_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("data.tokenizer: a tokenizer.json needs the 'tokenizers' package "
                             "(pip install tokenizers)") from None
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.tokenizer: no such file {path!r}")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the file is user input: report it, whatever tokenizers raises
            raise ValueError(f"data.tokenizer: {path!r} is not a valid tokenizer.json ({exc})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id: Optional[int] = None
        if eos_token is not None:
            self.eos_id = self._tok.token_to_id(eos_token)
            if self.eos_id is None:
                raise ValueError(f"data.eos_token: {eos_token!r} is not in the vocabulary of {path!r}")
        self.name = str(path)

    def encode(self, doc: bytes) -> list[int]:
        ids = self._tok.encode(doc.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return ids + ([self.eos_id] if self.eos_id is not None else [])

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def make_tokenizer(spec: str, eos_token: Optional[str] = None):
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, eos_token)


# ------------------------------------------------------------------------------------------- corpora


class FileCorpus:
    """Each file is one document."""

    def __init__(self, files: list[Path], description: str):
        if not files:
            raise ValueError(f"data: {description} holds no documents")
        self.files = files
        self.description = description

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> bytes:
        return self.files[i].read_bytes()


class JsonlCorpus:
    """One document per non-empty line: ``{"<text_key>": "..."}``."""

    def __init__(self, path: Path, text_key: str, *, allow_empty: bool = False):
        self.path, self.text_key = path, text_key
        self.offsets: list[int] = []  # byte offset of each non-empty line
        with path.open("rb") as f:
            offset = 0
            for line in f:
                if line.strip():
                    self.offsets.append(offset)
                offset += len(line)
        if not self.offsets and not allow_empty:  # a shard of a folder may be empty, the whole corpus not
            raise ValueError(f"data.path: {str(path)!r} holds no documents")
        self.description = str(path)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> bytes:
        with self.path.open("rb") as f:
            f.seek(self.offsets[i])
            line = f.readline()
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"data.path: {self.path}: document {i}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(self.text_key), str):
            raise ValueError(f"data.path: {self.path}: document {i}: expected an object with a string "
                             f"{self.text_key!r} field")
        return record[self.text_key].encode("utf-8")


class ConcatCorpus:
    """Corpora read one after another: document i is document i - start of the part holding it."""

    def __init__(self, parts: list, description: str):
        self.parts = parts
        self.starts = list(itertools.accumulate((len(p) for p in parts), initial=0))  # [len(parts) + 1]
        self.description = description
        if not self.starts[-1]:
            raise ValueError(f"data: {description} holds no documents")

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> bytes:
        part = bisect.bisect_right(self.starts, i) - 1
        return self.parts[part][i - self.starts[part]]


def _folder_corpus(root: Path, extensions: Sequence[str], text_key: str):
    """A folder's files in sorted order, each one document, except ``.jsonl`` files: one per line."""
    description = f"{root} ({', '.join(extensions)} files)"
    files = _sorted_files(root, tuple(extensions))
    if not any(f.suffix == ".jsonl" for f in files):
        return FileCorpus(files, description)
    parts = [JsonlCorpus(f, text_key, allow_empty=True) if f.suffix == ".jsonl" else FileCorpus([f], str(f))
             for f in files]
    return ConcatCorpus(parts, description)


def _sorted_files(root: Path, extensions: Sequence[str], exclude_dirs: Sequence[str] = ()) -> list[Path]:
    found = [p for p in root.rglob("*")
             if p.is_file() and p.suffix in extensions and not set(p.relative_to(root).parts[:-1]) & set(exclude_dirs)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus() -> FileCorpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _sorted_files(root, (".py",), exclude_dirs=("site-packages", "dist-packages", "__pycache__"))
    return FileCorpus(files, f"the Python standard library at {root}")


def make_corpus(source: str, path: Optional[str], *, text_key: str = "text", extensions: Sequence[str] = (".txt",)):
    if source == "stdlib":
        return stdlib_corpus()
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"data.path: no such file or folder {path!r}")
    if target.is_dir():
        return _folder_corpus(target, extensions, text_key)
    if target.suffix == ".jsonl":
        return JsonlCorpus(target, text_key)
    return FileCorpus([target], str(target))


# ------------------------------------------------------------------------------------------- packing


@dataclasses.dataclass
class StreamPosition:
    epoch: int = 0
    doc: int = 0
    offset: int = 0  # tokens of document ``doc`` already consumed

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class TokenStream:
    """The documents' tokens, concatenated, read sequentially from a position; wraps to a new epoch."""

    def __init__(self, corpus, tokenizer, position: Optional[StreamPosition] = None, *,
                 shuffle_seed: Optional[int] = None):
        self.corpus, self.tokenizer = corpus, tokenizer
        self.position = position or StreamPosition()
        self.shuffle_seed = shuffle_seed
        self._order_epoch: Optional[int] = None
        self._order: list[int] = []
        self._cached_doc: Optional[int] = None
        self._cached: Optional[torch.Tensor] = None

    def document_index(self, epoch: int, doc: int) -> int:
        """Which corpus document is the ``doc``-th one read in ``epoch``."""
        if self.shuffle_seed is None:
            return doc
        if self._order_epoch != epoch:
            self._order = list(range(len(self.corpus)))
            random.Random(self.shuffle_seed * 1_000_003 + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order[doc]

    def _doc_tokens(self, epoch: int, doc: int) -> torch.Tensor:
        i = self.document_index(epoch, doc)
        if self._cached_doc != i:
            self._cached = torch.tensor(self.tokenizer.encode(self.corpus[i]), dtype=torch.int64)
            self._cached_doc = i
        return self._cached

    def read(self, n: int, *, advance: bool = True) -> torch.Tensor:
        """The next ``n`` tokens, int64 [n]."""
        pos = dataclasses.replace(self.position)
        parts, need, empty_docs = [], n, 0
        while need > 0:
            tokens = self._doc_tokens(pos.epoch, pos.doc)
            take = tokens[pos.offset:pos.offset + need]
            parts.append(take)
            need -= take.numel()
            pos.offset += take.numel()
            empty_docs = empty_docs + 1 if take.numel() == 0 else 0
            if empty_docs > len(self.corpus):
                raise ValueError(f"data: every document of {self.corpus.description} encodes to zero tokens")
            if pos.offset >= tokens.numel():
                pos.doc, pos.offset = pos.doc + 1, 0
                if pos.doc == len(self.corpus):
                    pos.epoch, pos.doc = pos.epoch + 1, 0
        if advance:
            self.position = pos
        return torch.cat(parts)


class SequencePacker:
    """Fixed-shape batches [B, T + 1] from a :class:`TokenStream` (see the module docstring)."""

    def __init__(self, stream: TokenStream, batch_size: int, seq_len: int):
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len

    def next_batch(self) -> torch.Tensor:
        B, T = self.batch_size, self.seq_len
        body = self.stream.read(B * T)  # [B*T]
        last = self.stream.read(1, advance=False)  # the label of the last position
        flat = torch.cat([body, last])  # [B*T + 1]
        return flat.unfold(0, T + 1, T)  # [B, T + 1], rows overlapping by one token

    def state_dict(self) -> dict:
        return self.stream.position.as_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position ({epoch, doc, offset}, as ``state_dict`` wrote it); validated first."""
        keys = [f.name for f in dataclasses.fields(StreamPosition)]
        if not isinstance(state, dict):
            raise ValueError(f"checkpoint: data position: expected an object with keys {keys}, "
                             f"got {type(state).__name__}")
        missing, unexpected = [k for k in keys if k not in state], sorted(set(state) - set(keys), key=str)
        if missing or unexpected:
            raise ValueError(f"checkpoint: data position: expected keys {keys}, missing {missing}, "
                             f"unexpected {unexpected}")
        for key in keys:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"checkpoint: data position {key}: expected an int >= 0, got {value!r}")
        pos = StreamPosition(**{k: state[k] for k in keys})
        if pos.doc >= len(self.stream.corpus):
            raise ValueError(f"checkpoint: data position {state} is outside the corpus of "
                             f"{len(self.stream.corpus)} documents (was the data config changed?)")
        n_tokens = self.stream._doc_tokens(pos.epoch, pos.doc).numel()
        if pos.offset >= max(n_tokens, 1):  # read() moves to the next document once one is consumed
            raise ValueError(f"checkpoint: data position offset: expected < {max(n_tokens, 1)} (the tokens of "
                             f"document {pos.doc}), got {pos.offset} (was the data config changed?)")
        self.stream.position = pos


def build_packer(data_cfg, seed: int) -> SequencePacker:
    tokenizer = make_tokenizer(data_cfg.tokenizer, data_cfg.eos_token)
    corpus = make_corpus(data_cfg.source, data_cfg.path, text_key=data_cfg.text_key, extensions=data_cfg.extensions)
    stream = TokenStream(corpus, tokenizer, shuffle_seed=seed if data_cfg.shuffle else None)
    return SequencePacker(stream, data_cfg.batch_size, data_cfg.seq_len)
