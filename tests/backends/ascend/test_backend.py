"""The ascend backend's declaration and its behaviour on a machine without torch_npu."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from glm5_core import cli, registry
from glm5_core.backends.ascend import backend as ascend
from glm5_core.backends.ascend import vendor

NO_TORCH_NPU = importlib.util.find_spec("torch_npu") is None
needs_no_torch_npu = pytest.mark.skipif(not NO_TORCH_NPU, reason="torch_npu is installed here")


def test_declaration():
    be = registry.get_backend("ascend")
    assert (be.name, be.device_type, be.dist_backend) == ("ascend", "npu", "hccl")


def test_every_named_op_is_declared_and_every_kernel_can_decline():
    """The table and MISSING name declared ops only, never the same op twice, and each kernel can decline;
    an op named in neither gets the registry's default reason (a new op needs no edit here)."""
    table = ascend.kernel_table()
    assert set(table) | set(ascend.MISSING) <= set(registry.OP_NAMES)
    assert not set(table) & set(ascend.MISSING)
    for op, kernel in table.items():
        assert isinstance(kernel, registry.Kernel) and callable(kernel.supports), op


def test_an_op_ascend_does_not_name_gets_the_default_reason():
    spec = registry.OpSpec("moe_new_op", lambda x: x, family="moe")
    resolution = registry._resolve_in(spec, "ascend", registry.get_backend("ascend"), ascend.kernel_table())
    assert resolution.is_reference
    assert resolution.reason == registry.default_missing_reason(spec, "ascend")
    assert "ascend has no kernel for moe_new_op (moe family): the reference" in resolution.reason


def test_the_inference_only_vendor_ops_leave_gradient_calls_to_the_reference():
    """The fused vendor ops have no autograd formula: no record is differentiable, so the registry declines every
    call that needs gradients before ``supports`` (which would import torch_npu) is asked."""
    t = torch.zeros(2, 3, requires_grad=True)
    for op, kernel in ascend.kernel_table().items():
        assert not kernel.differentiable, op
        assert kernel.declines((t,), {}) == "the kernel has no backward and this call needs gradients", op


def test_import_glm5_core_and_the_kernel_table_never_import_torch_npu(tmp_path):
    """A torch_npu that explodes on import, first on the path: importing the package and building the
    ascend kernel table must not touch it (the vendor module is imported on the first kernel call only)."""
    (tmp_path / "torch_npu.py").write_text("raise ImportError('torch_npu was imported')\n")
    code = ("import glm5_core; from glm5_core import registry; registry.backends(); "
            "from glm5_core.backends.ascend import backend; backend.kernel_table(); print('clean')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr


@needs_no_torch_npu
def test_unavailable_here_with_the_reason():
    ok, why = registry.get_backend("ascend").available()
    assert not ok and "torch_npu is not installed" in why


@needs_no_torch_npu
def test_asking_for_ascend_fails_fast_with_the_reason():
    with pytest.raises(registry.BackendUnavailableError, match="ascend: torch_npu is not installed"):
        registry.resolve("moe_route", "ascend")
    with pytest.raises(registry.BackendUnavailableError, match="torch_npu"):
        with registry.use_backend("ascend"):
            pass


@needs_no_torch_npu
def test_ops_called_with_backend_ascend_fail_fast():
    from glm5_core.ops import moe

    with pytest.raises(registry.BackendUnavailableError, match="torch_npu"):
        moe.route(torch.randn(4, 8), top_k=2, backend="ascend")


@needs_no_torch_npu
def test_cli_reports_the_reason(capsys):
    assert cli.main(["backends"]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("ascend "))
    assert "no" in line.split() and "torch_npu is not installed" in line
    assert cli.main(["conformance", "--backend", "ascend"]) == 2
    assert "torch_npu is not installed" in capsys.readouterr().err


@needs_no_torch_npu
def test_the_vendor_namespace_is_imported_lazily():
    with pytest.raises(ModuleNotFoundError):
        vendor.vendor_ops()
    sentinel = object()
    assert vendor.vendor_ops(sentinel) is sentinel


def test_an_older_torch_npu_without_the_operator_is_declined_with_its_version():
    class OldTorchNpu:
        __version__ = "2.1.0.post3"

    ok, why = vendor.has_operator("npu_lightning_indexer", OldTorchNpu())
    assert not ok and "2.1.0.post3" in why and "npu_lightning_indexer" in why
    from tests.backends.ascend.vendor_semantics import AscendSemantics

    assert vendor.has_operator("npu_lightning_indexer", AscendSemantics()) == (True, "")


@pytest.mark.parametrize("soc, native", [("Ascend910B3", True), ("Ascend910_9391", True), ("Ascend910A", False),
                                         ("Ascend910ProB", False), ("Ascend310P3", False)])
def test_muon_auto_asks_the_npus_soc_whether_bf16_is_native(monkeypatch, soc, native):
    """ns_dtype: auto decided bf16 for cpu and cuda devices only: an Atlas A2 / A3 NPU computes bf16 natively."""
    import types

    from glm5_core.ops import muon

    fake_npu = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 0,
                                     get_device_name=lambda index: soc if index == 1 else "none")
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    npu1 = types.SimpleNamespace(type="npu", index=1)  # torch.device("npu", 1) needs torch_npu's registration
    assert muon.native_bf16_gemm(npu1) is native
    monkeypatch.delitem(sys.modules, "torch_npu")  # not imported: never asked, never imported
    assert muon.native_bf16_gemm(npu1) is False
