"""Corpora, tokenizers and packing: deterministic order, overlapping rows, resumable position."""
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from glm5_core.train.data import ByteTokenizer, HFTokenizer, SequencePacker, TokenStream, make_corpus, stdlib_corpus


def _packer(corpus, B=3, T=5, tokenizer=None):
    return SequencePacker(TokenStream(corpus, tokenizer or ByteTokenizer()), B, T)


def _expected_stream(corpus, tokenizer, n):
    """The concatenated token stream, repeated (epochs), built independently of TokenStream."""
    one_epoch = [t for i in range(len(corpus)) for t in tokenizer.encode(corpus[i])]
    return torch.tensor((one_epoch * (n // len(one_epoch) + 2))[:n])


@pytest.fixture
def text_corpus(tmp_path):
    for name, text in [("b.txt", "second doc"), ("a.txt", "first"), ("sub/c.txt", "third one here"), ("skip.bin", "x")]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    return make_corpus("path", str(tmp_path), extensions=[".txt"])


def test_folder_corpus_is_sorted_and_filtered(text_corpus):
    assert [text_corpus[i] for i in range(len(text_corpus))] == [b"first", b"second doc", b"third one here"]


def test_batches_are_consecutive_overlapping_windows_and_wrap_epochs(text_corpus):
    B, T, steps = 3, 5, 4  # 60 tokens > one epoch of 34: wraps
    packer = _packer(text_corpus, B, T)
    stream = _expected_stream(text_corpus, ByteTokenizer(), steps * B * T + 1)
    for s in range(steps):
        batch = packer.next_batch()
        assert batch.shape == (B, T + 1) and batch.dtype == torch.int64
        for r in range(B):
            start = (s * B + r) * T
            assert torch.equal(batch[r], stream[start:start + T + 1])
    assert packer.state_dict()["epoch"] >= 1


def test_resuming_from_the_saved_position_gives_the_same_batches(text_corpus):
    straight = _packer(text_corpus)
    expected = [straight.next_batch() for _ in range(5)]
    first = _packer(text_corpus)
    got = [first.next_batch() for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    second = _packer(text_corpus)
    second.load_state_dict(state)
    got += [second.next_batch() for _ in range(3)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_a_position_outside_the_corpus_is_rejected(text_corpus):
    with pytest.raises(ValueError, match="outside the corpus"):
        _packer(text_corpus).load_state_dict({"epoch": 0, "doc": 99, "offset": 0})


def test_byte_tokenizer_round_trips_and_ends_documents():
    tok = ByteTokenizer()
    ids = tok.encode("héllo".encode())
    assert ids[-1] == tok.eos_id and max(ids[:-1]) < 256
    assert tok.decode(ids) == "héllo"


def test_jsonl_corpus_reads_one_document_per_line_and_names_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n{"body": "x"}\n')
    corpus = make_corpus("path", str(path), text_key="text")
    assert len(corpus) == 3 and corpus[0] == b"one" and corpus[1] == b"two"
    with pytest.raises(ValueError, match="document 2: expected an object with a string 'text' field"):
        corpus[2]


def test_jsonl_files_in_a_folder_give_one_document_per_line(tmp_path):
    """A folder of .jsonl shards (in the default extensions) is read line by line, not as raw JSON text."""
    from glm5_core.train.config import DataConfig

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("plain")
    (tmp_path / "b.jsonl").write_text('{"body": "one"}\n\n{"body": "two \\"q\\""}\n')
    (tmp_path / "sub" / "c.jsonl").write_text('{"body": "three"}\n')
    (tmp_path / "d.md").write_text("last")
    corpus = make_corpus("path", str(tmp_path), text_key="body", extensions=DataConfig().extensions)
    docs = [corpus[i] for i in range(len(corpus))]
    assert docs == [b"plain", b"one", b'two "q"', b"last", b"three"]  # sorted by relative path
    stream = _packer(corpus, B=1, T=40).next_batch()[0]
    assert stream.tolist() == _expected_stream(corpus, ByteTokenizer(), 41).tolist()
    assert b"{" not in bytes(t for t in stream.tolist() if t < 256)


def test_an_empty_jsonl_shard_in_a_folder_holds_no_documents_but_an_empty_folder_is_an_error(tmp_path):
    from glm5_core.train.config import DataConfig

    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "b.jsonl").write_text("\n")  # an empty last shard, as a sharding job may write
    corpus = make_corpus("path", str(tmp_path), extensions=DataConfig().extensions)
    assert [corpus[i] for i in range(len(corpus))] == [b"one"]
    (tmp_path / "a.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no documents"):
        make_corpus("path", str(tmp_path), extensions=DataConfig().extensions)


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[EOS]": 0, "[UNK]": 1, "def": 2, "add": 3, "return": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = HFTokenizer(str(path), eos_token="[EOS]")
    assert hf.vocab_size == 5
    assert hf.encode(b"def add return zzz") == [2, 3, 4, 1, 0]
    with pytest.raises(ValueError, match="data.eos_token"):
        HFTokenizer(str(path), eos_token="</s>")


def test_stdlib_corpus_is_the_sorted_standard_library():
    corpus = stdlib_corpus()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in corpus.files]
    assert rel == sorted(rel) and len(rel) > 100
    assert all(r.endswith(".py") and "site-packages" not in r for r in rel)
    assert "os.py" in rel


def test_shuffled_order_is_a_seeded_permutation_per_epoch(tmp_path):
    for i in range(12):
        (tmp_path / f"d{i:02d}.txt").write_text(f"doc {i}")
    corpus = make_corpus("path", str(tmp_path), extensions=[".txt"])
    a = TokenStream(corpus, ByteTokenizer(), shuffle_seed=7)
    b = TokenStream(corpus, ByteTokenizer(), shuffle_seed=7)
    other = TokenStream(corpus, ByteTokenizer(), shuffle_seed=8)
    epoch0 = [a.document_index(0, d) for d in range(12)]
    epoch1 = [a.document_index(1, d) for d in range(12)]
    assert sorted(epoch0) == list(range(12)) and sorted(epoch1) == list(range(12))
    assert epoch0 != list(range(12)) and epoch0 != epoch1
    assert epoch0 == [b.document_index(0, d) for d in range(12)]
    assert epoch0 != [other.document_index(0, d) for d in range(12)]
    # The stream reads the documents in that order, and resumes in it.
    first_doc = corpus[epoch0[0]]
    assert torch.equal(a.read(len(first_doc)), torch.tensor(list(first_doc)))
    packer = SequencePacker(TokenStream(corpus, ByteTokenizer(), shuffle_seed=7), 2, 7)
    expected = [packer.next_batch() for _ in range(6)]
    resumed = SequencePacker(TokenStream(corpus, ByteTokenizer(), shuffle_seed=7), 2, 7)
    for _ in range(2):
        resumed.next_batch()
    state = resumed.state_dict()
    again = SequencePacker(TokenStream(corpus, ByteTokenizer(), shuffle_seed=7), 2, 7)
    again.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(expected[2:], [again.next_batch() for _ in range(4)]))
