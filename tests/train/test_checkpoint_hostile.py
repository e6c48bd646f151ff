"""Corrupt and hostile files in a training checkpoint and in an HF-layout directory: every one is a ValueError
(FileNotFoundError for a missing file) naming the file, tensor or key, raised within seconds (no FIFO hang, no
read of /dev/zero, no allocation sized by a header), and `glm5 pretrain --resume` / `glm5 rl --checkpoint`
turn it into one line and exit code 2 (231de35: SafetensorError / KeyError / RecursionError / OSError
tracebacks, a hang, a link out of the folder followed)."""
import json
import os
import pickle
import re
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm5_core.cli import main
from tests.train.small_run import CORPUS, SMALL_MODEL, small_model_kwargs, unblock_readers_later

STEP = "step_00000002"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A 2-step run (Muon and AdamW hold state) with its config file, an rl config of the same model, the
    checkpoint and the HF-layout export."""
    base = tmp_path_factory.mktemp("template")
    corpus = base / "corpus"
    corpus.mkdir()
    for i, text in enumerate(CORPUS * 3):
        (corpus / f"doc{i:02d}.txt").write_text(text)
    raw = dict(seed=3, torch_threads=1, output_dir=str(base / "run"), model=dict(SMALL_MODEL),
               data=dict(source="path", path=str(corpus), seq_len=24, batch_size=2),
               schedule=dict(lr=1e-2, warmup_steps=1), stages=[dict(kind="dense", steps=2)],
               loss=dict(mtp_depths=2, mtp_weight=0.3), router=dict(bias_update_rate=1e-2),
               logging=dict(progress_bar=False, tensorboard=False, plot=False, recall_every_steps=1))
    (base / "pretrain.yaml").write_text(yaml.safe_dump(raw))
    overrides = small_model_kwargs()
    (base / "rl.yaml").write_text(yaml.safe_dump({  # max_len within the small model's positions: the file is at fault
        "output_dir": str(base / "rl"), "torch_threads": 1, "rollout": {"max_len": 32},
        "model": {"preset": "tiny", "overrides": overrides}}))
    before = torch.get_num_threads()
    assert main(["pretrain", "--config", str(base / "pretrain.yaml"), "--backend", "cpu"]) == 0
    torch.set_num_threads(before)
    return base


@pytest.fixture
def run(template, tmp_path):
    """A copy of the template to damage: (run folder, config, rl config)."""
    shutil.copytree(template / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "run"


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks (a FIFO opened for reading) fails the test instead of hanging it."""
    def timeout(signum, frame):
        raise TimeoutError("a checkpoint read hung")
    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _huge_shape(path: Path) -> None:
    def edit(header):
        name = min(k for k in header if k != "__metadata__")
        header[name]["shape"] = [2 ** 40, 2 ** 30]
    _rewrite_header(path, edit)


def _consistent_huge_tensor(path: Path) -> str:
    """The last tensor of the file grown to 2**26 float32 values (256 MiB) by a sparse extension of the file:
    a valid safetensors file, whose header alone must get it refused. Returns the tensor's name."""
    size, grown = 2 ** 28, []

    def edit(header):
        name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        start = header[name]["data_offsets"][0]
        header[name].update(dtype="F32", shape=[size // 4], data_offsets=[start, start + size])
        grown.append(name)
    _rewrite_header(path, edit)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    os.truncate(path, 8 + n + end)
    return grown[0]


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _link(path: Path, target) -> None:
    path.unlink()
    os.symlink(target, path)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)
    unblock_readers_later(path)


def _sparse(path: Path, size: int) -> None:
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(size)


def _link_outside(path: Path) -> None:
    outside = path.parent.parent / f"outside-{path.name}"
    shutil.copyfile(path, outside)
    _link(path, outside)


def _edit_state(path: Path, edit) -> None:
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _nested_metadata(path: Path) -> None:
    tensors = load_file(str(path))
    save_file(tensors, str(path), metadata={"param_groups": _nested(100_000)})


def _non_finite(path: Path, value: float, prefix: str = "") -> None:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    name = min(k for k, t in tensors.items() if t.is_floating_point() and t.dim() > 0 and k.startswith(prefix))
    tensors[name].view(-1)[0] = value
    save_file(tensors, str(path), metadata=metadata)


# (file in the checkpoint folder, damage, what the one line must say)
CHECKPOINT_CASES = {
    "model_truncated": ("model.safetensors", _truncate, r"model\.safetensors: not a valid safetensors file"),
    "optimizer_truncated": ("optimizer.safetensors", _truncate, r"optimizer\.safetensors: not a valid safetensors"),
    "rng_truncated": ("rng.safetensors", _truncate, r"rng\.safetensors: not a valid safetensors file"),
    "model_huge_shape": ("model.safetensors", _huge_shape, r"model\.safetensors: not a valid safetensors file"),
    "optimizer_huge_tensor": ("optimizer.safetensors", _consistent_huge_tensor,
                              r"optimizer state of .*(got torch.float32 of shape \(67108864,\)|step: expected)"),
    "model_pickle": ("model.safetensors", lambda p: _replace(p, pickle.dumps({"weight": [0.0] * 8}, protocol=4)),
                     r"model\.safetensors: not a valid safetensors file"),
    "model_dev_zero": ("model.safetensors", lambda p: _link(p, "/dev/zero"),
                       r"model\.safetensors: resolves to /dev/zero, outside"),
    "model_proc_pagemap": ("model.safetensors", lambda p: _link(p, "/proc/self/pagemap"),
                           r"model\.safetensors: resolves to /proc/.*pagemap, outside"),
    "model_fifo": ("model.safetensors", _fifo, r"model\.safetensors: expected a regular file, got a FIFO"),
    "model_outside": ("model.safetensors", _link_outside, r"model\.safetensors: resolves to .*outside-model"),
    "model_nan": ("model.safetensors", lambda p: _non_finite(p, float("nan")),
                  r"model\.safetensors: tensor '\S+' holds 1 NaN / Inf values"),
    "optimizer_inf": ("optimizer.safetensors", lambda p: _non_finite(p, float("inf"), "adamw/"),
                      r"optimizer\.safetensors: tensor '\S+ \(adamw\) exp_avg\S*' holds 1 NaN / Inf"),
    "optimizer_nested_metadata": ("optimizer.safetensors", _nested_metadata,
                                  r"optimizer\.safetensors metadata param_groups: expected JSON nested at most 64"),
    "rng_sparse_huge": ("rng.safetensors", lambda p: _sparse(p, 2 ** 30),
                        r"rng\.safetensors: expected at most 16777216 bytes, got 1073741824"),
    "state_python_rng_object": ("trainer_state.json", lambda p: _edit_state(p, lambda s: s.update(python_rng={})),
                                r"trainer_state\.json python_rng: expected \[version, \[625 ints"),
    "state_nested": ("trainer_state.json", lambda p: p.write_text(_nested(100_000)),
                     r"trainer_state\.json: expected JSON nested at most 64 levels deep"),
    "state_sparse_6gib": ("trainer_state.json", lambda p: _sparse(p, 6 * 2 ** 30),
                          r"trainer_state\.json: expected at most 16777216 bytes, got 6442450944"),
    "state_fifo": ("trainer_state.json", _fifo, r"trainer_state\.json: expected a regular file, got a FIFO"),
}


def _resume(run: Path, template: Path, capsys) -> str:
    capsys.readouterr()
    before = torch.get_num_threads()
    code = main(["pretrain", "--config", str(template / "pretrain.yaml"), "--backend", "cpu",
                 "--output-dir", str(run.parent / "resumed"), "--resume", str(run)])
    torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_pretrain_resume_names_the_hostile_file_in_one_line(run, template, capsys, case):
    file, damage, message = CHECKPOINT_CASES[case]
    damage(run / "checkpoints" / STEP / file)
    err = _resume(run, template, capsys)
    assert err.startswith("glm5 pretrain: error: ")
    assert re.search(message, err), err


class _RecordingHandle:
    """A ``safe_open`` handle that records the names of the tensors whose data is read."""

    def __init__(self, real, reads):
        self._real, self._reads = real, reads

    def __enter__(self):
        self._handle = self._real.__enter__()
        return self

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def get_tensor(self, name):
        self._reads.append(name)
        return self._handle.get_tensor(name)


def test_a_huge_optimizer_tensor_is_refused_from_its_header_before_any_read(run, template, capsys, monkeypatch):
    """A valid optimizer.safetensors whose last tensor is 256 MiB (a sparse file): its header alone gets it
    refused, that tensor is never read (231de35 read each parameter's state, then compared shapes)."""
    import safetensors

    from glm5_core.train import checkpoint

    path = run / "checkpoints" / STEP / "optimizer.safetensors"
    huge = _consistent_huge_tensor(path)
    reads = {}
    real_open = safetensors.safe_open

    def recording_open(filename, *args, **kwargs):
        return _RecordingHandle(real_open(filename, *args, **kwargs), reads.setdefault(Path(filename).name, []))
    monkeypatch.setattr(safetensors, "safe_open", recording_open)
    if hasattr(checkpoint, "safe_open"):  # a module that imported it by name
        monkeypatch.setattr(checkpoint, "safe_open", recording_open)
    err = _resume(run, template, capsys)
    assert re.search(r"optimizer state of .*(got torch.float32 of shape \(67108864,\)|step: expected)", err), err
    assert "optimizer.safetensors" in reads and huge not in reads["optimizer.safetensors"], (huge, reads)


def test_the_untouched_copy_resumes(run, template, capsys):
    assert main(["pretrain", "--config", str(template / "pretrain.yaml"), "--backend", "cpu",
                 "--output-dir", str(run.parent / "resumed"), "--resume", str(run)]) == 0


RL_CASES = [c for c in CHECKPOINT_CASES if c.startswith("model_")]


@pytest.mark.parametrize("case", RL_CASES)
def test_rl_checkpoint_names_the_hostile_model_file_in_one_line(run, template, capsys, case):
    file, damage, message = CHECKPOINT_CASES[case]
    folder = run / "checkpoints" / STEP
    damage(folder / file)
    capsys.readouterr()
    before = torch.get_num_threads()
    code = main(["rl", "--config", str(template / "rl.yaml"), "--checkpoint", str(folder), "--backend", "cpu",
                 "--output-dir", str(run.parent / "rl")])
    torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def _shard(final: Path) -> Path:
    return sorted(final.glob("model-*.safetensors"))[0]


# (damage to the HF export folder, what the one line must say)
HF_CASES = {
    "config_nested": (lambda d: (d / "config.json").write_text('{"a": ' + _nested(100_000) + "}"),
                      r"config\.json: expected JSON nested at most 64 levels deep"),
    "index_nested": (lambda d: (d / "model.safetensors.index.json").write_text(_nested(100_000)),
                     r"model\.safetensors\.index\.json: expected JSON nested at most 64"),
    "config_outside": (lambda d: _link_outside(d / "config.json"), r"config\.json: resolves to .*outside-config"),
    "config_dev_zero": (lambda d: _link(d / "config.json", "/dev/zero"), r"config\.json: resolves to /dev/zero"),
    "shard_outside": (lambda d: _link_outside(_shard(d)), r"model-\S+\.safetensors: resolves to .*outside-model"),
    "shard_fifo": (lambda d: _fifo(_shard(d)), r"model-\S+\.safetensors: expected a regular file, got a FIFO"),
    "shard_truncated": (lambda d: _truncate(_shard(d)), r"model-\S+\.safetensors: not a valid safetensors file"),
    "shard_nan": (lambda d: _non_finite(_shard(d), float("nan")),
                  r"model-\S+\.safetensors: tensor '\S+' holds 1 NaN / Inf values"),
    "shard_inf": (lambda d: _non_finite(_shard(d), float("-inf")), r"tensor '\S+' holds 1 NaN / Inf values"),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_load_pretrained_and_rl_name_the_hostile_file(run, template, capsys, case):
    from glm5_core.model import load_pretrained

    damage, message = HF_CASES[case]
    final = run / "final"
    damage(final)
    with pytest.raises(ValueError, match=message):
        load_pretrained(final)
    capsys.readouterr()
    before = torch.get_num_threads()
    code = main(["rl", "--config", str(template / "rl.yaml"), "--checkpoint", str(final), "--backend", "cpu",
                 "--output-dir", str(run.parent / "rl")])
    torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_an_hf_cache_snapshot_whose_files_link_into_its_blobs_loads(run):
    """The Hugging Face hub cache layout: <repo>/snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    from glm5_core.model import load_pretrained

    repo = run.parent / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted((run / "final").iterdir())):
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f.name)
    load_pretrained(snapshot)
