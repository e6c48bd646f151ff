"""Config files and ``--set`` overrides read as untrusted YAML: every problem one line naming a line or a key.

A config file must be a regular file of at most ``MAX_FILE_BYTES``, UTF-8, one YAML document. Its nodes are
walked before anything is constructed: a key given twice in one mapping is an error (PyYAML keeps the last one
silently), and the document may expand to at most ``MAX_NODES`` nodes counting every use of an alias (a
"billion laughs" file is a few hundred bytes) and nest at most ``MAX_DEPTH`` deep.

``--set a.b=value`` (``stages[1].steps=20`` for list entries) puts ``value``, read as YAML, at that key of the
parsed file; the config's schema then checks it as if the file had said it, and :func:`blame_overrides` makes
a problem with a key that ``--set`` gave name ``--set``, not the file.
"""
from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import yaml

from glm5_core.config_schema import ConfigError

T = TypeVar("T")

MAX_FILE_BYTES = 1 << 20
MAX_NODES = 100_000
MAX_DEPTH = 64
_MERGE_TAG = "tag:yaml.org,2002:merge"
_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


def read_config_file(path: str, flag: str = "--config") -> str:
    """The text of a config file: a regular file (not a device, FIFO or folder) of at most MAX_FILE_BYTES."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag}: no such file {str(path)!r}") from None
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {str(path)!r} ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{flag}: expected a regular file, got {str(path)!r} (a folder, device or pipe)")
    if info.st_size > MAX_FILE_BYTES:
        raise ValueError(f"{flag}: expected a config of at most {MAX_FILE_BYTES} bytes, got {info.st_size} "
                         f"bytes in {str(path)!r}")
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag}: {str(path)!r} is not UTF-8 text (byte {exc.start})") from None


def load_yaml(text: str, source: str) -> Any:
    """One YAML document, parsed after the checks above; a problem raises ConfigError (one line)."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader refuses unprintable characters (NUL, ...) at once
        node = loader.get_single_node()  # composed recursively: a deep document exhausts the recursion limit
        if node is None:
            return None
        _check_nodes(node, source)
        return loader.construct_document(node)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError([f"nested more than {MAX_DEPTH} levels deep"], source) from None
    except yaml.reader.ReaderError as exc:
        raise ConfigError([f"character {exc.position + 1}: not valid YAML: unacceptable character "
                           f"#x{exc.character:04x} (control characters are not allowed)"], source) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise ConfigError([f"{where}not valid YAML: {what}"], source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"],
                          source) from None
    except (ValueError, OverflowError) as exc:  # a scalar the constructor cannot make (a date 2024-13-45, an int
        # of more digits than Python converts)
        raise ConfigError([f"not valid YAML: {str(exc).splitlines()[0]}"], source) from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Duplicate keys, expanded size and depth, walked with an explicit stack (no recursion to exhaust)."""
    expanded = 0
    checked = set()  # mappings already searched for duplicates (an alias reuses its anchor's node)
    stack: list[tuple] = [(root, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        expanded += 1
        if expanded > MAX_NODES:
            raise ConfigError([f"{path or 'the document'}: expands to more than {MAX_NODES} values (aliases "
                               f"counted at each use); a config is far smaller"], source)
        if depth > MAX_DEPTH:
            raise ConfigError([f"{path}: nested more than {MAX_DEPTH} levels deep"], source)
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            if id(node) not in checked:
                checked.add(id(node))
                _check_duplicates(node, path, source)
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                stack.append((key, path, depth + 1))
                stack.append((value, f"{path}.{name}" if path else str(name), depth + 1))


def _check_duplicates(node: yaml.MappingNode, path: str, source: str) -> None:
    seen: dict[tuple, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
            continue
        ident = (key.tag, key.value)
        if ident in seen:
            full = f"{path}.{key.value}" if path else key.value
            raise ConfigError([f"{full}: duplicate key (lines {seen[ident]} and {key.start_mark.line + 1}); "
                               f"YAML would keep only the last one"], source)
        seen[ident] = key.start_mark.line + 1


def load_mapping(path: str, *, empty: Optional[dict] = None) -> dict[str, Any]:
    """A config file's top-level mapping; an empty file gives ``empty`` (None: an empty file is an error)."""
    raw = load_yaml(read_config_file(path), str(path))
    if raw is None and empty is not None:
        return dict(empty)
    if not isinstance(raw, dict):
        raise ConfigError([f"expected a mapping of sections at the top level, got {type(raw).__name__}"], str(path))
    return raw


# ------------------------------------------------------------------------------------------- --set


def _shown_text(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


def parse_key(key: str) -> list[tuple[str, list[int]]]:
    """``"a.b[1].c"`` -> [("a", []), ("b", [1]), ("c", [])]."""
    segments = []
    for part in key.split("."):
        match = _SEGMENT.fullmatch(part)
        if match is None:
            raise ConfigError([f"{key}: expected dotted names with optional [index] (e.g. stages[0].steps), "
                               f"got {part!r}"], "--set")
        segments.append((match.group(1), [int(i) for i in re.findall(r"\d+", match.group(2))]))
    return segments


def assign(raw: dict[str, Any], key: str, value: Any) -> None:
    """Put ``value`` at dotted ``key`` of ``raw`` (missing sections are created; list entries must exist)."""
    steps = [(name, index) for name, indices in parse_key(key) for index in [None, *indices]]
    node: Any = raw
    walked = ""
    for n, (name, index) in enumerate(steps):
        last = n == len(steps) - 1
        if index is None:
            if not isinstance(node, dict):
                raise ConfigError([f"{key}: {walked} is not a section (it holds {type(node).__name__})"], "--set")
            walked = f"{walked}.{name}" if walked else name
            if last:
                node[name] = value
            else:
                node = node.setdefault(name, [] if steps[n + 1][1] is not None else {})
        else:
            if not isinstance(node, list) or index >= len(node):
                held = f"{len(node)} entries" if isinstance(node, list) else f"a {type(node).__name__}"
                raise ConfigError([f"{key}: no entry {walked}[{index}] ({walked} holds {held})"], "--set")
            walked = f"{walked}[{index}]"
            if last:
                node[index] = value
            else:
                node = node[index]


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``raw`` with each ``KEY=VALUE`` (VALUE read as YAML) assigned in order."""
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError([f"expected KEY=VALUE (e.g. data.batch_size=16), got {_shown_text(text)}"], "--set")
        assign(raw, key, load_yaml(value_text, f"--set {key}"))
    return raw


def blame_overrides(error: ConfigError, overrides: Sequence[str]) -> ConfigError:
    """``error`` (the schema's verdict on a file plus ``overrides``) with the problems about keys an override
    gave blamed on ``--set``: its source when they all are, else each such problem marked ``(from --set)``.
    A problem is an override's when its leading key is the override's key, inside it, or a section it made."""
    keys = [text.partition("=")[0].strip() for text in overrides]

    def from_override(problem: str) -> bool:
        head = problem.split(":", 1)[0]
        return any(head == key or head.startswith((key + ".", key + "[")) or key.startswith((head + ".", head + "["))
                   for key in keys if key)

    blamed = [from_override(problem) for problem in error.problems]
    if not any(blamed):
        return error
    if all(blamed):
        return ConfigError(error.problems, f"--set (over {error.source})")
    return ConfigError([f"{problem} (from --set)" if by_set else problem
                        for problem, by_set in zip(error.problems, blamed)], error.source)


def load_config_file(path, sets: Sequence[str], values: Optional[dict[str, Any]],
                     parse: Callable[[dict[str, Any], str], T], *, empty: Optional[dict] = None) -> T:
    """The one way a config file is read, for pretraining and RL alike: the YAML mapping at ``path`` (``empty``: what
    an empty file stands for; None refuses it), then the ``--set KEY=VALUE`` overrides ``sets`` (VALUE read as YAML),
    then ``values`` (dotted key -> value, as command-line flags give them, assigned as they are), then
    ``parse(data, source)``; the problems an override caused are blamed on ``--set``."""
    data = apply_overrides(load_mapping(str(path), empty=empty), sets)
    for key, value in (values or {}).items():
        assign(data, key, value)
    try:
        return parse(data, str(path))
    except ConfigError as exc:
        raise blame_overrides(exc, sets) from None
