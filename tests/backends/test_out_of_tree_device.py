"""docs/writing-a-backend.md's out-of-tree example, run as written in 2 processes (torch.multiprocessing, gloo)
against a Python stand-in for a privateuse1 torch plug-in: the device renamed ``mydev`` and its device module
(set_device, per-device RNG states), hooks and device guard registered by torch's own
``_setup_privateuseone_for_python_backend``. Each process joins the group on ``mydev:<rank>`` (torch had no
``torch.privateuseone`` to set the device with: an AttributeError on the first distributed run), and a
checkpoint's RNG file holds the device's state and restores it (they were silently not saved)."""
from __future__ import annotations

import os
import re
import socket
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
DOC = Path(__file__).resolve().parents[2] / "docs" / "writing-a-backend.md"


def doc_example() -> str:
    """The first python block after "### Out-of-tree" in the doc."""
    text = DOC.read_text()
    section = text[text.index("### Out-of-tree"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def install_stand_in_plugin(device_count: int = 1) -> types.ModuleType:
    """What a privateuse1 plug-in's import does for glm5-core's purposes: rename the device, register its
    module. The module keeps one RNG state (a uint8 tensor) per device, as torch.cuda's functions do."""
    module = types.ModuleType("torch_mydev")
    module.states = [torch.zeros(8, dtype=torch.uint8) for _ in range(device_count)]
    module.current = None
    module.device_count = lambda: device_count
    module.is_available = lambda: True
    module.current_device = lambda: 0 if module.current is None else module.current.index

    def set_device(device):
        module.current = torch.device(device)

    module.set_device = set_device
    module.get_rng_state_all = lambda: [s.clone() for s in module.states]

    def set_rng_state_all(states):
        for i, state in enumerate(states):
            module.states[i] = state.clone()

    module.set_rng_state_all = set_rng_state_all
    # torch's own registration of a Python privateuse1 backend (rename, device module, hooks, device guard:
    # what a C++ plug-in registers), torch/utils/backend_registration.py
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename="mydev", backend_module=module)
    return module


def _worker(rank: int, port: int, root: str, example: str) -> None:
    import dataclasses

    from glm5_core.train.checkpoint import _restore_rng, _rng_tensors
    from glm5_core.train.distributed import init_distributed, shutdown

    plugin = install_stand_in_plugin()
    namespace: dict = {}
    exec(compile(example, str(DOC), "exec"), namespace)  # the doc's block, as written
    backend = namespace["BACKEND"]
    assert backend.device_type == "mydev"
    # its SDK's collective library is not here: the same facts with gloo
    backend = dataclasses.replace(backend, facts=dataclasses.replace(backend.facts, dist_backend="gloo"),
                                  dist_backend="gloo")
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx = init_distributed(backend)
    try:
        assert ctx.device == torch.device("mydev", rank) and plugin.current == ctx.device, (ctx, plugin.current)
        plugin.states[0] = torch.full((8,), 10 + rank, dtype=torch.uint8)
        from safetensors.torch import save_file
        path = Path(root) / f"rng_{rank}.safetensors"
        saved = _rng_tensors("mydev")
        assert set(saved) == {"torch_cpu", "mydev_0"} and int(saved["mydev_0"][0]) == 10 + rank, saved.keys()
        save_file(saved, str(path))
        plugin.states[0] = torch.zeros(8, dtype=torch.uint8)
        _restore_rng(path, "mydev")
        assert int(plugin.states[0][0]) == 10 + rank
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, int(plugin.states[0][0]))
        assert gathered == [10, 11], gathered
    finally:
        shutdown(ctx)
    os._exit(0)  # see tests/train/test_distributed.py: no interpreter teardown with gloo threads around


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_the_docs_out_of_tree_example_runs_distributed_and_saves_its_device_rng(tmp_path, spawnable_test_modules):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), doc_example()), nprocs=WORLD, join=True)


def test_a_device_type_torch_does_not_know_is_one_line():
    from glm5_core.device_facts import torch_device_module

    with pytest.raises(ValueError) as info:
        torch_device_module("nosuchdev")
    assert "\n" not in str(info.value) and "'nosuchdev'" in str(info.value)


def test_a_device_module_without_rng_functions_is_refused_not_skipped(monkeypatch):
    """Saving no RNG state for the device would silently break bitwise resume: refused, naming the functions."""
    from glm5_core.train.checkpoint import _rng_tensors

    bare = types.ModuleType("bare")
    monkeypatch.setattr(torch, "get_device_module", lambda name: bare if name == "baredev" else sys.exit(1))
    with pytest.raises(ValueError, match=r"torch\.baredev has no get_rng_state_all .*resume would not be bitwise"):
        _rng_tensors("baredev")
