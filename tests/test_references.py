"""Every repository path the docs and the code's docstrings and comments name exists.

What counts as a repository path (the rule this test applies, so a reader can predict it):

- a token of path characters that contains a ``/`` and either ends in one of ``EXTENSIONS`` or ends in ``/``
  (a folder), after stripping a trailing pytest node id (``::test_x``), a ``:LINE`` suffix and punctuation;
- whose first component is a folder at the repository's top level (``glm5_core/``, ``tests/``, ``benchmarks/``,
  ``configs/``, ``docs/``, ...: resolved against the repository root) or a sub-folder of ``glm5_core/``
  (``backends/triton/table.py``, ``rl/serving/``, ...: resolved against ``glm5_core/``). Paths of other
  repositories (Megatron's ``megatron/core/...``, transformers' ``models/...``, vLLM's ``vllm/...``) start with
  folders this repository does not have and are not checked;
- ``{a,b}`` alternatives are expanded and each must exist; a ``*`` is a glob that must match something; tokens
  inside URLs, absolute paths and placeholders (``<vendor>``, ``NAME``, ``...``) are not paths, nor are the
  docs' worked examples: a path with a ``_``-separated word ``foo`` or ``myvendor`` (``backends/myvendor/``,
  ``glm5_core/ops/foo.py``, ``tests/reference/test_foo_reference.py``).

Scanned: README.md, docs/*.md, benchmarks/**/*.md, configs/*.yaml (comments), and the docstrings and comments of
glm5_core/**/*.py, benchmarks/**/*.py and tests/**/*.py. The failure lists every broken reference as
``file:line: path``, all at once.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "glm5_core"

EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".cpp", ".h", ".cu", ".cuh", ".sh", ".txt",
              ".png", ".log", ".toml", ".ini", ".cfg")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
_TOKEN = re.compile(r"[A-Za-z0-9_./*{},\-<>$]+(?:::[A-Za-z0-9_\[\]\-.]+)?")
_PLACEHOLDER = re.compile(r"<|>|\$|\.\.\.|(^|/)[A-Z][A-Z0-9_]*(/|\.|$)")
EXAMPLE_WORDS = {"foo", "myvendor"}  # the op and the vendor docs/writing-a-backend.md adds as its worked example


def _folders(root: Path) -> set:
    """The folders of ``root`` that belong to the repository: not ``.git``, not what git ignores (a run's ``runs/``,
    a build folder), so a path into them is checked as the repository's own."""
    names = {p.name for p in root.iterdir() if p.is_dir() and p.name not in (".git", "__pycache__")}
    try:
        ignored = subprocess.run(["git", "check-ignore", "--", *sorted(names)], cwd=root, capture_output=True,
                                 text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):  # no git: every folder counts
        ignored = []
    return names - {Path(name).name for name in ignored}


TOP = _folders(REPO)
SUB = _folders(PACKAGE)


def _expand(token: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    return [path for alt in match.group(1).split(",")
            for path in _expand(token[:match.start()] + alt + token[match.end():])]


def _candidate(token: str) -> str:
    """The path a token names, or '' when it names none under the rule above."""
    token = token.split("::")[0]
    token = re.sub(r":\d+(-\d+)?$", "", token)
    token = token.strip(".,;:'\"`()")
    if "/" not in token or token.startswith(("/", "~", ".")) or _PLACEHOLDER.search(token):
        return ""
    if not (token.endswith("/") or token.endswith(EXTENSIONS)):
        return ""
    if any(word in EXAMPLE_WORDS for part in token.split("/") for word in re.split(r"[_.]", part)):
        return ""
    first = token.split("/")[0]
    return token if first in TOP or first in SUB else ""


def _exists(path: str) -> bool:
    base = REPO if path.split("/")[0] in TOP else PACKAGE
    if "*" in path:
        return any(base.glob(path.rstrip("/")))
    target = base / path
    return target.is_dir() if path.endswith("/") else target.exists()


def references(text: str, first_line: int = 1) -> Iterator[tuple[int, str]]:
    """(line, path) for every repository path named in ``text`` (whose first line is ``first_line``)."""
    for offset, line in enumerate(text.splitlines()):
        line = _URL.sub(" ", line)
        for token in _TOKEN.findall(line):
            for path in _expand(token):
                path = _candidate(path)
                if path:
                    yield first_line + offset, path


def _python_prose(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every comment and docstring of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                yield first.lineno, first.value.value


def _yaml_comments(source: str) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(source.splitlines(), 1):
        if "#" in line:
            yield number, line[line.index("#"):]


def scanned_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").rglob("*.md")),
             *sorted((REPO / "configs").glob("*.yaml"))]
    for folder in ("glm5_core", "benchmarks", "tests"):
        files += sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return [p for p in files if p.is_file()]


def broken_references() -> list[str]:
    broken = []
    for path in scanned_files():
        source = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            prose = _python_prose(source)
        elif path.suffix == ".yaml":
            prose = _yaml_comments(source)
        else:
            prose = iter([(1, source)])
        for first_line, text in prose:
            for line, ref in references(text, first_line):
                if not _exists(ref):
                    broken.append(f"{path.relative_to(REPO)}:{line}: {ref}")
    return sorted(set(broken), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


def test_every_repository_path_in_the_docs_and_comments_exists():
    broken = broken_references()
    assert not broken, f"{len(broken)} references to paths not in the repository:\n" + "\n".join(broken)


def test_the_rule_resolves_package_relative_paths_and_ignores_other_repositories():
    found = dict((path, line) for line, path in references(
        "see glm5_core/registry.py, backends/triton/ and tests/{test_cli,test_registry}.py::test_x:12\n"
        "Megatron's megatron/core/transformer/dsa.py, transformers' models/glm/modeling.py,\n"
        "https://github.com/x/y/blob/main/glm5_core/nope.py, backends/<vendor>/backend.py, runs/tiny/final/,\n"
        "the example glm5_core/ops/foo.py and backends/myvendor/"))
    assert found == {"glm5_core/registry.py": 1, "backends/triton/": 1, "tests/test_cli.py": 1,
                     "tests/test_registry.py": 1}
    assert all(_exists(path) for path in found)
    assert not _exists("glm5_core/no_such_module.py") and not _exists("backends/no_such_vendor/")


def test_a_missing_path_is_reported_with_its_line():
    refs = list(references("line one\nthe table lives in backends/triton/no_such_table.py.\n", first_line=10))
    assert refs == [(11, "backends/triton/no_such_table.py")]
    assert not _exists(refs[0][1])


def _status_rows() -> list[tuple[int, list[str]]]:
    """(line, cells) of each row of the README's status table (the table under "## Status")."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Status"))
    rows = []
    for number, line in enumerate(lines[start:], start + 1):
        if line.startswith("## ") and rows:
            break
        if line.startswith("| ") and not line.startswith(("| what |", "|---")):
            rows.append((number, [cell.strip() for cell in line.strip().strip("|").split(" | ")]))
    return rows


def test_each_status_row_gives_its_command_and_its_results_files_exist():
    rows = _status_rows()
    assert len(rows) > 20
    problems = []
    for line, cells in rows:
        if len(cells) != 4 or not cells[2].startswith("`") or cells[2].startswith("`..."):
            problems.append(f"README.md:{line}: no full command in the third column: {cells[2:3]}")
        for name in re.findall(r"`([A-Za-z0-9_{},.\-]+\.(?:json|md)|[A-Za-z0-9_]+/)`", " ".join(cells)):
            for path in _expand(name):
                in_results = REPO / "benchmarks" / "results" / path
                if not (in_results.exists() or _candidate(path) and _exists(path)):
                    problems.append(f"README.md:{line}: {path} is not in benchmarks/results/")
    assert not problems, "\n".join(problems)
