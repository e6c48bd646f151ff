"""glm5_core.safe_files: the one reader of untrusted files (regular files inside their directory, size caps,
JSON depth bounded before parsing, safetensors errors and non-finite weights as ValueErrors naming the file)."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from glm5_core.safe_files import (
    MAX_JSON_DEPTH,
    check_finite,
    checkpoint_root,
    open_safetensors,
    parse_json,
    read_bytes,
    read_json,
)


def _nested(depth: int, opener: str = "[") -> str:
    closer = "]" if opener == "[" else "}"
    return opener * depth + closer * depth if opener == "[" else '{"a":' * depth + "1" + closer * depth


@pytest.mark.parametrize("opener", ["[", "{"])
def test_json_at_the_depth_limit_parses_and_one_more_is_refused(opener):
    assert parse_json(_nested(MAX_JSON_DEPTH, opener), "x") is not None
    with pytest.raises(ValueError, match=r"x: expected JSON nested at most 64 levels deep"):
        parse_json(_nested(MAX_JSON_DEPTH + 1, opener), "x")


@pytest.mark.parametrize("text", ["[" * 200_000, "[" * 100_000 + "]" * 100_000, "]" * 5000 + "[" * 5000])
def test_deep_or_unbalanced_nesting_is_refused_without_recursing(text):
    with pytest.raises(ValueError, match=r"nested at most 64 levels deep, got deeper nesting \(or unbalanced"):
        parse_json(text, "x")


def test_brackets_inside_strings_do_not_count():
    value = {"s": "[" * 1000 + '\\"{' * 1000, "t": ['"]]]"']}
    assert parse_json(json.dumps(value), "x") == value


@pytest.mark.parametrize("text", ['{"a": [1}', "[1, 2", '{"a": 1', "\xff", "1" * 5000])
def test_malformed_json_is_a_value_error_naming_it(text):
    with pytest.raises(ValueError, match=r"^x: not valid JSON"):
        parse_json(text, "x")


def test_read_json_refuses_what_is_not_a_regular_file_inside_the_root(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (tmp_path / "outside.json").write_text("{}")
    (root / "inside.json").write_text('{"a": 1}')
    os.symlink(tmp_path / "outside.json", root / "out.json")
    os.symlink("inside.json", root / "alias.json")
    os.symlink("/dev/zero", root / "zero.json")
    os.mkfifo(root / "fifo.json")
    (root / "dir.json").mkdir()
    assert read_json(root / "alias.json", root=root, max_bytes=100) == {"a": 1}  # a link inside is fine
    for name, message in [("out.json", r"resolves to .*outside\.json, outside"), ("zero.json", "resolves to /dev/zero"),
                          ("fifo.json", "expected a regular file, got a FIFO"),
                          ("dir.json", "expected a regular file, got a directory")]:
        with pytest.raises(ValueError, match=rf"{name}: {message}"):
            read_json(root / name, root=root, max_bytes=100)
    with pytest.raises(FileNotFoundError, match="missing.json: no such file"):
        read_json(root / "missing.json", root=root, max_bytes=100)
    with pytest.raises(ValueError, match=r"inside\.json: expected at most 4 bytes, got 8"):
        read_json(root / "inside.json", root=root, max_bytes=4)


def test_read_bytes_stops_at_the_cap_for_files_whose_size_stat_does_not_tell():
    with pytest.raises(ValueError, match=r"expected at most 8 bytes, got more"):
        read_bytes("/proc/self/status", root="/proc", max_bytes=8)


def test_hf_cache_snapshots_may_link_into_their_repo_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    assert checkpoint_root(repo / "snapshots" / "abc") == str(repo)
    assert checkpoint_root(tmp_path) == str(tmp_path)


def test_safetensors_errors_name_the_file_and_tensor(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=r"w\.safetensors: not a valid safetensors file \(SafetensorError"):
        with open_safetensors(path, root=tmp_path):
            pass
    save_file({"a": torch.zeros(2)}, str(path))
    with open_safetensors(path, root=tmp_path) as f:
        with pytest.raises(ValueError, match=r"w\.safetensors: tensor 'b'"):
            f.get_tensor("b")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_named(value):
    weights = torch.zeros(3, 4)
    weights[1, 2] = value
    with pytest.raises(ValueError, match=r"f: tensor 'w' holds 1 NaN / Inf values"):
        check_finite("w", weights, "f")
    check_finite("w", torch.zeros(3, dtype=torch.int64), "f")  # integers are always finite
    check_finite("w", torch.ones(3, 4, dtype=torch.bfloat16), "f")
