"""Detection of the six vendor stacks (musa, mlu, gcu through their extension modules; kunlunxin, metax, hygon, whose
torch builds present their devices as ``cuda``), each on its simulated stack and next to NVIDIA's and AMD's: the
``cuda``-presenting stacks are told apart from each other and from NVIDIA / AMD by their documented markers only
(SMI tools, torch build strings, ``torch.version``), and an absent or broken stack says why in one line.

The NVIDIA and AMD stacks here are written from what their torch builds report (``torch.version.cuda`` /
``torch.version.hip``, ``get_device_name``); the SMI outputs are illustrative lines naming the product (no capture
of the real tools was at hand, docs/vendors/kunlunxin.md): detection reads only their exit status, and for
``xpu-smi`` (a name Intel's GPU tool shares) whether a Kunlunxin product is listed."""
import dataclasses
import sys

import pytest
import torch

from glm5_core import device_kinds, registry
from glm5_core.backends import simulated
from glm5_core.backends.simulated import GIB, SimulatedStack
from glm5_core.rl.fleet import placement
from tests.backends.vendors.conftest import NEW_VENDORS

NVIDIA = SimulatedStack(device_type="cuda", device_name="NVIDIA H200", device_count=8, total_memory=141 * GIB,
                        torch_version="2.8.0+cu128", version_attrs={"cuda": "12.8", "hip": None})
AMD = SimulatedStack(device_type="cuda", device_name="AMD Instinct MI300X", device_count=8, total_memory=192 * GIB,
                     torch_version="2.8.0+rocm6.4", version_attrs={"cuda": None, "hip": "6.4.43482"},
                     tools={"rocm-smi": "GPU[0] : AMD Instinct MI300X"})
INTEL_TOOL_ON_NVIDIA = dataclasses.replace(NVIDIA, tools={"xpu-smi": "Device 0: Intel(R) Data Center GPU Max 1550"})
PRESENTING = ("kunlunxin", "metax", "hygon")


def detected() -> set:
    return {name for name, b in registry.backends().items() if name != "cpu" and b.detect()}


@pytest.mark.parametrize("vendor", NEW_VENDORS)
def test_each_vendor_stack_is_detected_and_chosen_over_cuda_and_rocm(vendor):
    with simulated.simulate_stack(simulated.stack_of(vendor)):
        assert vendor in detected() and not detected() & (set(NEW_VENDORS) - {vendor})
        assert registry.resolve_backend_name() == vendor  # auto-detection
        ok, reason = registry.get_backend(vendor).available()
        assert ok and simulated.stack_of(vendor).device_name in reason and "\n" not in reason
    assert vendor not in detected()  # restored: this host has none


@pytest.mark.parametrize("stack, chosen", [(NVIDIA, "cuda"), (AMD, "rocm"), (INTEL_TOOL_ON_NVIDIA, "cuda")],
                         ids=["nvidia", "amd", "intel-xpu-smi-on-nvidia"])
def test_nvidia_and_amd_stacks_detect_no_new_vendor(stack, chosen):
    with simulated.simulate_stack(stack):
        assert detected() == {chosen} and registry.resolve_backend_name() == chosen
        assert device_kinds.facts_for("cuda") is registry.get_backend(chosen).facts
        why = {name: registry.get_backend(name).available()[1] for name in PRESENTING}
    if stack is INTEL_TOOL_ON_NVIDIA:
        assert "xpu-smi runs but lists no Kunlunxin device" in why["kunlunxin"]
    assert all("\n" not in line and line for line in why.values())


def test_the_presenting_stacks_are_told_apart_by_their_own_markers_only():
    metax, hygon = simulated.stack_of("metax"), simulated.stack_of("hygon")
    # the MetaX build string alone (mx-smi absent) is a marker; a plain CUDA build with mx-smi absent is not MetaX
    with simulated.simulate_stack(dataclasses.replace(metax, tools={})):
        assert detected() >= {"metax", "cuda"} and registry.resolve_backend_name() == "metax"
    with simulated.simulate_stack(dataclasses.replace(metax, torch_version="2.8.0+cu128", tools={})):
        assert "metax" not in detected() and registry.resolve_backend_name() == "cuda"
    # Hygon: a HIP build with "dtk" in its build string, or hy-smi; an AMD build has neither
    with simulated.simulate_stack(dataclasses.replace(hygon, tools={})):
        assert registry.resolve_backend_name() == "hygon"
    with simulated.simulate_stack(dataclasses.replace(hygon, torch_version="2.8.0+rocm6.4")):  # hy-smi only
        assert registry.resolve_backend_name() == "hygon"
    # a marker of a vendor on another vendor's build type is no detection (mx-smi beside a HIP build)
    with simulated.simulate_stack(dataclasses.replace(AMD, tools={"mx-smi": "MetaX C500"})):
        assert detected() == {"rocm"}
        assert "torch.version.cuda is None" in registry.get_backend("metax").available()[1]


@pytest.mark.parametrize("vendor, env", [("kunlunxin", "XPU_VISIBLE_DEVICES"), ("metax", "CUDA_VISIBLE_DEVICES"),
                                         ("hygon", "HIP_VISIBLE_DEVICES")])
def test_rl_placement_reads_the_presenting_vendors_facts(vendor, env):
    with simulated.simulate_stack(simulated.stack_of(vendor)):
        assert device_kinds.facts_for("cuda") is registry.get_backend(vendor).facts
        assert placement.worker_environment("cuda:3") == {env: "3"}
    assert placement.worker_environment("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}  # this host's build


def test_absent_stacks_say_why_in_one_line():
    for vendor in NEW_VENDORS:
        ok, reason = registry.get_backend(vendor).available()
        assert not ok and reason and "\n" not in reason, (vendor, reason)
    assert registry.get_backend("musa").available()[1].startswith("torch_musa is not installed")
    assert "torch.version.cuda is None" in registry.get_backend("metax").available()[1]


def test_a_broken_stack_says_why_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "torch_mlu.py").write_text("raise RuntimeError('libcnrt.so: cannot open shared object file\\n"
                                           "second line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ok, reason = registry.get_backend("mlu").available()
    assert not ok and reason.startswith("torch_mlu failed to import: RuntimeError(") and "\n" not in reason
    assert "torch_mlu" not in sys.modules
    monkeypatch.setitem(sys.modules, "torch_musa", None)  # a module import blocked
    simulated.forget_probes()
    ok, reason = registry.get_backend("musa").available()
    assert not ok and "failed to import" in reason and "\n" not in reason
    # a device query that raises (a driver mismatch after import)
    stack = simulated.stack_of("gcu")
    with simulated.simulate_stack(stack):
        def broken():
            raise RuntimeError("TOPS driver version mismatch\nsee dmesg")

        monkeypatch.setattr(torch.gcu, "is_available", broken)
        simulated.forget_probes()
        ok, reason = registry.get_backend("gcu").available()
    assert not ok and reason.startswith("torch.gcu query failed: RuntimeError(") and "\n" not in reason


def test_glm5_backends_lists_every_backend_with_its_reason():
    from glm5_core.cli_backends import backend_report, render

    records = backend_report()
    assert {"cpu", "cuda", "rocm", "ascend", *NEW_VENDORS} <= {r["backend"] for r in records}
    for r in records:
        assert r["available"] or (r["reason"] and "\n" not in r["reason"])
        assert "ops_error" not in r, r
        assert all(info["reason"] for info in r["ops"].values() if info["impl"] == "reference")
    table = render(records).split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(records)  # one line per backend, as before
