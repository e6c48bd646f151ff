"""Restoring accelerator RNG states on a node with a different device count (no GPU needed: fake states, and
a fake device module for the end-to-end restore)."""
import types

import pytest
import torch
from safetensors.torch import save_file

from glm5_core.train.checkpoint import _device_rng_states, _restore_rng


def _fake_states(n: int, device_type: str = "cuda"):
    """``n`` device states, state ``i`` filled with ``i`` (so order is visible), plus the CPU state."""
    states = {f"{device_type}_{i}": torch.full((4,), i, dtype=torch.uint8) for i in range(n)}
    states["torch_cpu"] = torch.get_rng_state()
    return states


def _indices(states):
    return [int(s[0]) for s in states]


def test_states_are_ordered_by_device_index_not_by_name():
    states = _fake_states(12)
    shuffled = dict(sorted(states.items()))  # cuda_0, cuda_1, cuda_10, cuda_11, cuda_2, ...
    assert _indices(_device_rng_states(shuffled, "cuda", 12)) == list(range(12))


@pytest.mark.parametrize("saved, devices", [(12, 4), (2, 1), (3, 8), (0, 2), (5, 0)])
def test_min_of_saved_and_present_devices_are_restored(saved, devices, recwarn):
    got = _device_rng_states(_fake_states(saved), "cuda", devices)
    assert _indices(got) == list(range(min(saved, devices)))
    warned = [w for w in recwarn if "RNG states" in str(w.message)]
    assert len(warned) == (1 if saved > devices else 0)
    if warned:
        assert f"holds RNG states of {saved} cuda devices, this node has {devices}" in str(warned[0].message)


def test_other_device_types_are_ignored():
    states = {**_fake_states(2, "npu"), **_fake_states(3, "cuda")}
    assert _indices(_device_rng_states(states, "npu", 8)) == [0, 1]


@pytest.mark.parametrize("key, message", [
    ("cuda_x", r"unexpected RNG state 'cuda_x' \(expected cuda_<device index>\)"),
    ("cuda_-1", r"unexpected RNG state 'cuda_-1'"),
    ("cuda_5", r"cuda RNG states of devices \[0, 1, 5\], expected devices 0\.\.2"),
])
def test_bad_device_keys_are_named(key, message):
    states = _fake_states(2)
    states[key] = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        _device_rng_states(states, "cuda", 8)


class _FakeDevices:
    """The two functions ``_restore_rng`` uses of ``torch.cuda`` / ``torch.npu``, for ``count`` devices;
    like torch's, ``set_rng_state_all`` indexes devices by position and fails past the last one."""

    def __init__(self, count: int):
        self.count = count
        self.restored = None

    def device_count(self) -> int:
        return self.count

    def set_rng_state_all(self, states):
        if len(states) > self.count:
            raise IndexError(f"device {self.count} does not exist")
        if any(s.dtype != torch.uint8 for s in states):
            raise TypeError("RNG state must be a torch.ByteTensor")
        self.restored = list(states)


@pytest.mark.parametrize("saved, devices", [(11, 3), (3, 11), (11, 11)])
def test_restore_on_a_node_with_a_different_device_count(saved, devices, tmp_path, monkeypatch, recwarn):
    fake = _FakeDevices(devices)
    monkeypatch.setattr(torch, "fakedev", types.SimpleNamespace(device_count=fake.device_count,
                                                                 set_rng_state_all=fake.set_rng_state_all),
                        raising=False)
    path = tmp_path / "rng.safetensors"
    save_file(_fake_states(saved, "fakedev"), str(path))
    _restore_rng(path, "fakedev")
    assert _indices(fake.restored) == list(range(min(saved, devices)))


def test_invalid_device_state_is_a_value_error(tmp_path, monkeypatch):
    fake = _FakeDevices(2)
    monkeypatch.setattr(torch, "fakedev", fake, raising=False)
    states = _fake_states(2, "fakedev")
    states["fakedev_1"] = torch.zeros(4, dtype=torch.float32)
    path = tmp_path / "rng.safetensors"
    save_file(states, str(path))
    with pytest.raises(ValueError, match=r"does not hold valid RNG states \(RNG state must be a torch.ByteTensor\)"):
        _restore_rng(path, "fakedev")


def test_missing_cpu_state_is_named(tmp_path):
    path = tmp_path / "rng.safetensors"
    save_file({"cuda_0": torch.zeros(4, dtype=torch.uint8)}, str(path))
    with pytest.raises(ValueError, match=r"lacks the torch_cpu RNG state"):
        _restore_rng(path, "cpu")
