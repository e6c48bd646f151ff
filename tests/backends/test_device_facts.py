"""Each vendor folder declares its device facts once (``backends/<vendor>/device.py``), the registry's Backend
holds them, and the code outside the vendor folders (RL placement, weight-update groups, config choices,
``glm5 backends``) reads them: a device type nobody edited RL code for is placed like the built-in ones."""
import importlib

import pytest
import torch

from glm5_core import device_kinds, registry
from glm5_core.device_facts import COMMON_DTYPES, DeviceFacts
from glm5_core.rl.fleet import placement

BUILTIN = ("cpu", "cuda", "rocm", "ascend")


@pytest.mark.parametrize("name", BUILTIN)
def test_each_builtin_backend_holds_its_vendor_folders_facts(name):
    be = registry.get_backend(name)
    assert be.facts is importlib.import_module(f"glm5_core.backends.{name}.device").DEVICE
    assert (be.device_type, be.dist_backend) == (be.facts.device_type, be.facts.dist_backend)


def test_the_builtin_facts():
    facts = {name: registry.get_backend(name).facts for name in BUILTIN}
    assert facts["cpu"].is_host and facts["cpu"].visible_devices_env is None and facts["cpu"].ray_options() == {}
    assert (facts["cuda"].visible_devices_env, dict(facts["cuda"].ray_options())) == (
        "CUDA_VISIBLE_DEVICES", {"num_gpus": 1})
    assert (facts["rocm"].device_type, facts["rocm"].dist_backend, facts["rocm"].visible_devices_env) == (
        "cuda", "nccl", "HIP_VISIBLE_DEVICES")
    assert dict(facts["rocm"].ray_options()) == {"num_gpus": 1}
    assert (facts["ascend"].visible_devices_env, dict(facts["ascend"].ray_options())) == (
        "ASCEND_RT_VISIBLE_DEVICES", {"resources": {"NPU": 1}})
    assert facts["ascend"].supports(torch.bfloat16) and not facts["ascend"].supports(torch.float64)
    for name in ("cpu", "cuda", "rocm"):
        assert facts[name].dtypes == COMMON_DTYPES and facts[name].supports(torch.int64)
    for name in ("cuda", "rocm", "ascend"):
        assert not facts[name].is_host and isinstance(facts[name].count(), int)


def test_a_shared_device_type_speaks_for_the_vendor_of_this_torch_build(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert device_kinds.facts_for("cuda") is registry.get_backend("cuda").facts
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert device_kinds.facts_for("cuda") is registry.get_backend("rocm").facts
    assert placement.worker_environment("cuda:3") == {"HIP_VISIBLE_DEVICES": "3"}
    kinds = list(device_kinds.device_types())  # other vendors' device types may follow (a new vendor edits no test)
    assert kinds[0] == "cpu" and {"cuda", "npu"} <= set(kinds)


def test_backends_declared_by_device_type_alone_still_work():
    be = registry.Backend(name="legacy", device_type="cpu", dist_backend="gloo", probe=lambda: (True, ""),
                          kernel_table=dict)
    assert be.facts == DeviceFacts("cpu", "gloo") and be.facts.is_host
    facts = DeviceFacts("toydev", "toyccl", count=lambda: 1)
    be = registry.Backend(name="new", facts=facts, probe=lambda: (True, ""), kernel_table=dict)
    assert (be.device_type, be.dist_backend, be.device()) == ("toydev", "toyccl", "toydev")
    with pytest.raises(ValueError, match="dist_backend: expected 'toyccl'"):
        registry.Backend(name="new", dist_backend="gloo", facts=facts, probe=lambda: (True, ""), kernel_table=dict)
    with pytest.raises(TypeError, match="expected facts="):
        registry.Backend(name="none", probe=lambda: (True, ""), kernel_table=dict)


@pytest.fixture
def toy_vendor(monkeypatch):
    """An out-of-tree vendor with device type ``toydev``: no RL file knows it."""
    facts = DeviceFacts("toydev", "toyccl", visible_devices_env="TOYDEV_VISIBLE_DEVICES", ray_resource="TOY",
                        count=lambda: 2)
    toy = registry.Backend(name="toy", facts=facts, probe=lambda: (True, "toy"), kernel_table=dict)
    known = dict(registry.backends(), toy=toy)
    monkeypatch.setattr(registry, "backends", lambda: known)
    return toy


def test_a_new_vendors_device_type_is_placed_without_editing_rl_code(toy_vendor):
    assert placement.parse_devices("toydev:1, cpu", "rollout.devices") == ["toydev:1", "cpu"]
    assert placement.worker_environment("toydev:1") == {"TOYDEV_VISIBLE_DEVICES": "1"}
    assert placement.in_worker_device("toydev:1") == "toydev:0"
    assert placement.ray_resources("toydev:0") == {"resources": {"TOY": 1}}
    assert placement.probe_accelerators()["toydev"] == 2
    placement.check_visible(["toydev:1"], "train.device", placement.probe_accelerators)
    with pytest.raises(ValueError, match="train.device: toydev:2 is not visible.*sees 2 toydev devices"):
        placement.check_visible(["toydev:2"], "train.device", placement.probe_accelerators)
    with pytest.raises(ValueError, match="rollout.devices: expected an index for toydev"):
        placement.parse_device("toydev", "rollout.devices")
    assert "toyccl" in device_kinds.DIST_BACKEND_NAMES


def test_unknown_device_types_are_refused_naming_the_key_and_the_known_types():
    with pytest.raises(ValueError, match=r"train.device: expected a device such as 'cpu', ('[a-z]+:0', )*'cuda:0'"
                                         r".*'npu:0'.*, got 'tpu:0'"):
        placement.parse_device("tpu:0", "train.device")


def test_distributed_backends_come_from_the_facts():
    from glm5_core.rl.config import SYNC_BACKENDS
    from glm5_core.rl.serving.weight_group import BACKENDS, WeightUpdateGroup

    names = tuple(BACKENDS)  # the built-in vendors' in their order; another vendor's may come between
    assert tuple(SYNC_BACKENDS) == names and [n for n in names if n in ("gloo", "nccl", "hccl")] == ["gloo", "nccl",
                                                                                                    "hccl"]
    assert "nccl" in BACKENDS and "mpi" not in BACKENDS and repr(BACKENDS) == repr(names)
    with pytest.raises(ValueError, match=r"backend: expected one of \('gloo', .*'nccl', .*'hccl'.*\), got 'mpi'"):
        WeightUpdateGroup(master_address="127.0.0.1", master_port=1234, rank=0, world_size=2, backend="mpi")


def test_muon_asks_the_device_facts_whether_bf16_gemms_are_native(monkeypatch):
    from glm5_core.ops import muon

    fake = DeviceFacts("cpu", "gloo", native_bf16_gemm=lambda device: device.type == "cpu")
    monkeypatch.setattr(device_kinds, "facts_for", lambda kind: fake if kind == "cpu" else None)
    assert muon.native_bf16_gemm(torch.device("cpu")) is True
    assert muon.native_bf16_gemm(torch.device("meta")) is False


def test_glm5_backends_reports_each_backends_dtypes():
    from glm5_core.cli_backends import backend_report

    records = {r["backend"]: r for r in backend_report(["cpu", "ascend"])}
    assert "float64" in records["cpu"]["dtypes"] and "bfloat16" in records["cpu"]["dtypes"]
    assert "float64" not in records["ascend"]["dtypes"]
