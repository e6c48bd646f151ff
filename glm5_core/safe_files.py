"""Reading the files a run did not write in this process (checkpoints, HF directories): untrusted input.

Every such read goes through here, and a file is read only if
  * its resolved path lies inside the directory it belongs to (``root``): a symlink may point elsewhere in
    that directory, never out of it (not to ``/dev/zero``, ``/proc/self/pagemap`` or another user's file);
  * it is a regular file (a FIFO would block the reader forever, a device never ends);
  * it is no larger than the caller's cap, checked before anything is read (and the read itself stops
    there, for files whose size ``stat`` does not tell).
JSON is checked for nesting depth before it is parsed (100k nested brackets are a RecursionError inside
``json.loads``). Safetensors errors become ValueErrors naming the file and, while one is read, the tensor.
Every refusal is a ValueError naming the file, except a file that does not exist: FileNotFoundError naming it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterator
from typing import Any, Optional, Union

PathLike = Union[str, os.PathLike]
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")  # openers to '(', closers to ')'
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def checkpoint_root(directory: PathLike) -> str:
    """The folder a checkpoint directory's files must resolve into: the directory itself, or, for a Hugging
    Face hub cache snapshot (``<repo>/snapshots/<revision>/``, whose files are links to ``<repo>/blobs/``),
    the repo folder."""
    real = os.path.realpath(os.fspath(directory))
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
        return repo
    return real


def checked_path(path: PathLike, *, root: PathLike, max_bytes: Optional[int] = None) -> str:
    """The resolved path of ``path`` once it is known to be a regular file inside ``root`` of at most
    ``max_bytes`` bytes (None: any size). Raises FileNotFoundError or ValueError naming the file."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path}: no such file")
    real, real_root = os.path.realpath(path), os.path.realpath(os.fspath(root))
    if not _inside(real, real_root):
        raise ValueError(f"{path}: resolves to {real}, outside {real_root}; expected a file inside the directory")
    try:
        info = os.stat(real)
    except OSError as exc:
        raise ValueError(f"{path}: cannot stat ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: expected a regular file, got {_kind(info.st_mode)}")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ValueError(f"{path}: expected at most {max_bytes} bytes, got {info.st_size}")
    return real


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def read_bytes(path: PathLike, *, root: PathLike, max_bytes: int) -> bytes:
    """The bytes of a regular file inside ``root``, at most ``max_bytes`` of them (more is a ValueError)."""
    real = checked_path(path, root=root, max_bytes=max_bytes)
    try:  # O_NONBLOCK: a FIFO swapped in after the check opens at once instead of blocking; fstat refuses it
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"{os.fspath(path)}: cannot open ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{os.fspath(path)}: expected a regular file, got {_kind(os.fstat(fd).st_mode)}")
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ValueError(f"{os.fspath(path)}: cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{os.fspath(path)}: expected at most {max_bytes} bytes, got more")
    return data


def check_json_depth(data: Union[bytes, str], what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON text nested deeper than ``max_depth`` arrays / objects, without recursing: strings are
    cut out, the brackets kept, and each pass removes every innermost pair (one level). Pairs left after
    ``max_depth`` passes are deeper nesting; more unpaired brackets than that are refused too (a few are
    left to ``json.loads``, which reports them with a position)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    skeleton = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS).translate(_BRACKETS)
    for _ in range(max_depth):
        reduced = skeleton.replace(b"()", b"")
        if len(reduced) == len(skeleton):
            break
        skeleton = reduced
    if b"()" in skeleton or len(skeleton) > max_depth:
        raise ValueError(f"{what}: expected JSON nested at most {max_depth} levels deep, got deeper nesting "
                         f"(or unbalanced brackets)")


def parse_json(data: Union[bytes, str], what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of untrusted text: depth checked first, every failure a ValueError naming ``what``."""
    check_json_depth(data, what, max_depth)
    try:
        return json.loads(data)
    except RecursionError:  # unreachable after the depth check; kept so no input can escape as one
        raise ValueError(f"{what}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int literals past the digit limit
        raise ValueError(f"{what}: not valid JSON ({exc})") from None


def read_json(path: PathLike, *, root: PathLike, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed JSON of a regular file inside ``root`` (see :func:`read_bytes`, :func:`parse_json`)."""
    return parse_json(read_bytes(path, root=root, max_bytes=max_bytes), os.fspath(path), max_depth)


class SafetensorsFile:
    """An open safetensors file whose every call raises ValueError naming the file (and tensor) on bad data."""

    def __init__(self, handle, path: str):
        self._handle, self.path = handle, path

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{self.path}: {what}: {exc}") from None
        except Exception as exc:  # SafetensorError, OSError, RuntimeError from a file that lies about itself
            raise ValueError(f"{self.path}: {what}: {type(exc).__name__}: {exc}") from None

    def keys(self) -> list[str]:
        return self._call("cannot list tensors", self._handle.keys)

    def metadata(self) -> dict[str, str]:
        return self._call("cannot read the metadata", self._handle.metadata) or {}

    def get_slice(self, name: str):
        return self._call(f"tensor {name!r}", self._handle.get_slice, name)

    def get_tensor(self, name: str):
        return self._call(f"tensor {name!r}", self._handle.get_tensor, name)


@contextlib.contextmanager
def open_safetensors(path: PathLike, *, root: PathLike, max_bytes: Optional[int] = None) -> Iterator[SafetensorsFile]:
    """``safetensors.safe_open`` (torch tensors on cpu, never pickle) of a regular file inside ``root``."""
    from safetensors import safe_open

    real = checked_path(path, root=root, max_bytes=max_bytes)
    try:
        handle = safe_open(real, framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError (bad header), OSError
        raise ValueError(f"{os.fspath(path)}: not a valid safetensors file ({type(exc).__name__}: {exc})") from None
    with handle as f:
        yield SafetensorsFile(f, os.fspath(path))


def check_finite(name: str, tensor, where: str) -> None:
    """A loaded weight must be finite: NaN / Inf is refused here, naming the tensor, not found by a loss later."""
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()):
        return
    flat = tensor.reshape(-1)  # [numel], checked in chunks: the mask never costs more than 16 MB
    if flat.element_size() == 1:  # fp8 (no isfinite kernel): checked in fp32, a chunk at a time
        bad = sum(int((~torch.isfinite(chunk.float())).sum()) for chunk in flat.split(1 << 22))
    else:
        bad = sum(int((~torch.isfinite(chunk)).sum()) for chunk in flat.split(1 << 24))
    if bad:
        raise ValueError(f"{where}: tensor {name!r} holds {bad} NaN / Inf values; expected finite weights")
