"""Fuzz of training checkpoint folders: files of a small real checkpoint are truncated, overwritten with random
bytes, given huge or inconsistent safetensors headers, replaced by pickles, links (to /dev/zero, /proc, a
folder, outside the checkpoint, nowhere), FIFOs, sparse huge files, deeply nested or mistyped JSON. Resolving and
loading the damaged folder either works or raises a ValueError / FileNotFoundError of one line naming the
damaged file or key: never another exception, never a hang (a SIGALRM bounds each example)."""
import json
import os
import shutil
import signal
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.optim import OptimizerConfig, build_optimizer
from glm5_core.train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from tests.train.small_run import small_model_kwargs, unblock_readers_later

FILES = ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json"]
STATE_KEYS = ["format_version", "step", "world_size", "python_rng", "data"]


MODEL = small_model_kwargs()


def _model_and_optimizer():
    model = GLM5ForCausalLM(GLM5Config.tiny(**MODEL))
    model.reset_parameters(seed=0)
    return model, build_optimizer(model, OptimizerConfig(), num_heads=MODEL["num_attention_heads"], lr=1e-2,
                                  backend="cpu")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A checkpoints root whose one checkpoint holds Muon and AdamW state (one step on random gradients)."""
    root = tmp_path_factory.mktemp("fuzz") / "checkpoints"
    model, optimizer = _model_and_optimizer()
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    save_checkpoint(root, step=1, model=model, optimizer=optimizer, data_state={"epoch": 0, "doc": 0, "offset": 0},
                    world_size=1, device_type="cpu", keep_last=1)
    return root


def _header(raw: bytes):
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)

# one damage: (kind, file, parameters)
damages = st.one_of(
    st.tuples(st.just("truncate"), st.sampled_from(FILES + ["latest"]), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.sampled_from(FILES + ["latest"]),
              st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("random"), st.sampled_from(FILES + ["latest"]), st.binary(max_size=256)),
    st.tuples(st.just("header"), st.sampled_from(FILES[:3]),
              st.tuples(st.sampled_from(["shape", "dtype", "data_offsets", "metadata"]),
                        st.integers(0, 100), json_values)),
    st.tuples(st.just("pickle"), st.sampled_from(FILES), st.just(None)),
    st.tuples(st.just("link"), st.sampled_from(FILES + ["latest"]),
              st.sampled_from(["/dev/zero", "/proc/self/pagemap", "/proc/self/mem", ".", "outside", "nowhere"])),
    st.tuples(st.just("fifo"), st.sampled_from(FILES + ["latest"]), st.just(None)),
    st.tuples(st.just("sparse"), st.sampled_from(FILES + ["latest"]), st.integers(2 ** 20, 2 ** 34)),
    st.tuples(st.just("nested"), st.just("trainer_state.json"),
              st.tuples(st.integers(60, 200_000), st.sampled_from(["[", '{"a":']))),
    st.tuples(st.just("state_key"), st.just("trainer_state.json"),
              st.tuples(st.sampled_from(STATE_KEYS), json_values)),
    st.tuples(st.just("step_link"), st.just("latest"), st.just(None)),
)


def _damage(root: Path, kind: str, file: str, arg) -> str:
    """Apply one damage; returns the word the error must name (the file, or the key of trainer_state.json)."""
    folder = root / "step_00000001"
    path = root / "latest" if file == "latest" else folder / file
    if kind == "step_link":  # the step folder moved elsewhere, a link left in its place
        elsewhere = root.parent / "elsewhere"
        if not elsewhere.exists():
            os.rename(folder, elsewhere)
            os.symlink(elsewhere, folder)
        return "step_00000001"
    if not path.is_file() or path.is_symlink():
        return file  # an earlier damage made it something else: leave it
    raw = path.read_bytes()
    if kind == "truncate":
        os.truncate(path, int(len(raw) * arg))
    elif kind == "flip":
        data = bytearray(raw)
        for where, value in arg:
            if data:
                data[min(int(where * len(data)), len(data) - 1)] = value
        path.write_bytes(bytes(data))
    elif kind == "random":
        path.write_bytes(arg)
    elif kind == "header":
        field, index, value = arg
        try:
            n, header = _header(raw)
        except (ValueError, struct.error):  # an earlier damage broke the header
            return file
        names = sorted(k for k in header if k != "__metadata__" and isinstance(header[k], dict)) \
            if isinstance(header, dict) else []
        if not isinstance(header, dict):
            return file
        if field == "metadata":
            header["__metadata__"] = value
        elif names:
            header[names[index % len(names)]][field] = value
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    elif kind == "pickle":
        import pickle

        path.write_bytes(pickle.dumps({"weight": list(range(8))}, protocol=4))
    elif kind == "link":
        path.unlink()
        if arg == "outside":
            target = root.parent / f"outside-{file}"
            target.write_bytes(raw)
        else:
            target = arg if arg.startswith("/") or arg == "." else root.parent / arg
        os.symlink(target, path)
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
        unblock_readers_later(path)
    elif kind == "sparse":
        with open(path, "r+b") as f:
            f.truncate(arg)
    elif kind == "nested":
        depth, opener = arg
        closer = "]" if opener == "[" else "}"
        path.write_text(opener * depth + "1" + closer * depth)
    elif kind == "state_key":
        key, value = arg
        try:
            state = json.loads(raw)
        except (ValueError, RecursionError):  # an earlier damage broke the JSON
            return file
        if not isinstance(state, dict):
            return file
        state[key] = value
        path.write_text(json.dumps(state))
        return f"trainer_state.json {key}"  # the file and the key
    return file


def _alarm(signum, frame):
    raise TimeoutError("a checkpoint read hung")


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(damages, min_size=1, max_size=3))
def test_a_damaged_checkpoint_loads_or_is_one_clear_error(template, plan):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        shutil.copytree(template, root)
        named = {_damage(root, *damage) for damage in plan}
        model, optimizer = _model_and_optimizer()
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(60)
        try:
            folder = resolve_checkpoint(root, log=lambda message: None)
            load_checkpoint(folder, model=model, optimizer=optimizer, total_steps=10, world_size=1,
                            device_type="cpu")
        except (ValueError, FileNotFoundError) as exc:
            message = str(exc)
            assert "\n" not in message.strip(), message
            assert any(word in message for word in named | {"latest"}), (plan, message)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
