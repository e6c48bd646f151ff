"""Fuzz: random mutations of the shipped configs, through the CLI (``--check-config``: nothing is built).

Each mutation sets a value (of any YAML type, sizes included), renames or deletes a key, or adds one (a
GLM5Config field or a made-up name). Whatever comes, the command returns 0 (a valid config) or 2 with exactly
one line naming a key, and never a traceback.

A check that allocates from a config number (it once listed one entry per ``rollout.num_engines``: 24 GB for a
drawn 3e9) must fail its example, not take the machine down: each check runs under a soft address-space limit
a little above what the process maps (an allocation past it is a MemoryError here) and an alarm."""
import contextlib
import copy
import re
import resource
import signal
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5_core.cli import main
from glm5_core.model import GLM5Config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"pretrain": ROOT / "configs" / "tiny.yaml", "rl": ROOT / "configs" / "rl_tiny.yaml"}
KEY_PATH = re.compile(r"(\d+ problems: )?[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*)*: ")

VALUES = st.one_of(
    st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=12),
    st.sampled_from([0, 1, -1, 2, 3, 7, 64, 2 ** 24, 2 ** 31, 10 ** 9, 2 ** 64, 10 ** 400, "1e9", "5e-3", "many",
                     "/dev/zero", "", "tiny", "sparse", "dense", "async", ".txt", [0.9, 0.95], [0.9, 1.5],
                     "{a}+{b}={b:3000000000}", "runs/a\0b"]),  # a size in text; a path the OS cannot name
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.sampled_from(["kind", "steps", "name", "x"]), st.integers(-2, 2), max_size=2),
)
NEW_KEYS = st.one_of(st.sampled_from(list(GLM5Config.field_names()) + ["preset", "overrides", "name"]),
                     st.from_regex(r"[a-z_]{1,10}", fullmatch=True))


EXAMPLE_HEADROOM_BYTES = 2 << 30  # what one check may map beyond the process (a check needs a few MB)
EXAMPLE_SECONDS = 60  # a check takes well under a second


class ExampleTimedOut(BaseException):
    """Raised by the alarm: not an Exception, so no ``except Exception`` / ``OSError`` of the code under test
    turns it into a clean error."""


def _mapped_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


def _alarm(signum, frame):
    raise ExampleTimedOut("a config check ran past its time limit")


@contextlib.contextmanager
def bounded_example(headroom_bytes: int = EXAMPLE_HEADROOM_BYTES, seconds: float = EXAMPLE_SECONDS):
    """Run the body with RLIMIT_AS (soft: raised back after) at the mapped size plus ``headroom_bytes``, and a
    SIGALRM after ``seconds``; Linux only (elsewhere the body runs unbounded)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _mapped_bytes() + headroom_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    previous = signal.signal(signal.SIGALRM, _alarm)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


def _paths(node, prefix=()):
    """(path, is_section) of every key and list entry; a path is a tuple of keys and indices."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        path = prefix + (key,)
        yield path, isinstance(value, dict)
        yield from _paths(value, path)


def _parent(raw, path):
    node = raw
    for key in path[:-1]:
        node = node[key]
    return node


def _mutate(raw, data) -> str:
    """Apply one random mutation; return the key name the error must mention ('' when any key will do)."""
    paths = list(_paths(raw))
    op = data.draw(st.sampled_from(["value", "value", "rename", "delete", "add"]))
    if op == "add":
        sections = [()] + [p for p, is_section in paths if is_section]
        section = data.draw(st.sampled_from(sections))
        key = data.draw(NEW_KEYS)
        node = raw
        for k in section:
            node = node[k]
        node[key] = data.draw(VALUES)
        return key
    path = data.draw(st.sampled_from([p for p, _ in paths]))
    parent, last = _parent(raw, path), path[-1]
    if op == "value":
        parent[last] = data.draw(VALUES)
        return last if isinstance(last, str) else ""
    if isinstance(parent, list):  # renaming or deleting a list entry: drop it
        del parent[last]
        return ""
    value = parent.pop(last)
    if op == "rename":
        new = data.draw(st.sampled_from([last + "s", last[:-1], last.upper(), "x" + last]))
        parent[new] = value
        return new
    return ""


def _check_one(command, raw, must_name, tmp_path, capsys):
    path = tmp_path / "fuzzed.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with bounded_example():
        rc = main([command, "--config", str(path), "--check-config"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if rc == 0:
        assert err == "" and yaml.safe_load(out)  # the resolved config
        return
    assert rc == 2, (rc, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    prefix = f"glm5 {command}: error: {path}: "
    assert err.startswith(prefix), err
    assert KEY_PATH.match(err[len(prefix):]) or err[len(prefix):].startswith("line "), err
    if must_name:
        assert str(must_name) in err, (must_name, err)


# in-process under bounded_example, an example takes ~5-85 ms (a subprocess each would cost ~2 s): 300 a command
# is ~15 s of CPU in all. With the num_engines list, NUL paths, template widths and the lines of a dense stage's
# indexer_lr and of indexer_types fixed, 10000 a command passed with --hypothesis-seed=4 (20000 with seed 3)
@pytest.mark.parametrize("command", ["pretrain", "rl"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_config_is_valid_or_one_line_naming_a_key(command, data, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    monkeypatch.chdir(tmp_path)  # relative output_dir / data paths resolve in an empty folder
    raw = copy.deepcopy(yaml.safe_load(CONFIGS[command].read_text()))
    must_name = _mutate(raw, data)
    _check_one(command, raw, must_name, tmp_path, capsys)


@pytest.mark.parametrize("command", ["pretrain", "rl"])
def test_the_unmutated_configs_pass(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    _check_one(command, yaml.safe_load(CONFIGS[command].read_text()), "", tmp_path, capsys)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")
def test_an_example_that_maps_too_much_or_hangs_fails_without_harm():
    import mmap
    import time

    with pytest.raises(OSError), bounded_example(headroom_bytes=64 << 20):
        mmap.mmap(-1, 256 << 20)  # address space only: never touched, so harmless where the limit did not bite
    with pytest.raises(ExampleTimedOut), bounded_example(seconds=0.2):
        time.sleep(30)
    with mmap.mmap(-1, 256 << 20):  # both bounds are lifted after the example
        time.sleep(0.3)
