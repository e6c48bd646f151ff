"""Registry contract: resolution order, explicit-unavailable errors, fallbacks, strict mode, entry points."""
import subprocess
import sys
import textwrap

import pytest
import torch

import glm5_core
from glm5_core import registry
from glm5_core.ops import muon


@pytest.fixture
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


def test_import_probes_nothing_and_imports_no_vendor_sdk():
    code = ("import sys, glm5_core, glm5_core.ops; "
            "print(sorted(m for m in ('triton', 'torch_npu', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_builtin_backends_declare_devices_and_dist_backends():
    known = registry.backends()
    in_tree = ["cpu", "cuda", "rocm", "ascend"]  # by priority (a new vendor folder may sort among them)
    assert [name for name in known if name in in_tree] == in_tree and list(known)[0] == "cpu"
    assert (known["cpu"].device_type, known["cpu"].dist_backend) == ("cpu", "gloo")
    assert (known["cuda"].device_type, known["cuda"].dist_backend) == ("cuda", "nccl")
    assert (known["rocm"].device_type, known["rocm"].dist_backend) == ("cuda", "nccl")
    assert (known["ascend"].device_type, known["ascend"].dist_backend) == ("npu", "hccl")
    assert known["cpu"].available()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_resolution_order(monkeypatch):
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    assert registry.resolve_backend_name() == "cpu"  # hardware
    monkeypatch.setenv("GLM5_BACKEND", "ascend")
    assert registry.resolve_backend_name() == "ascend"  # env beats hardware
    assert registry.resolve_backend_name("cpu") == "cpu"  # argument beats env
    monkeypatch.setenv("GLM5_BACKEND", "auto")
    assert registry.resolve_backend_name() == "cpu"
    with glm5_core.use_backend("cpu"):
        monkeypatch.setenv("GLM5_BACKEND", "ascend")
        assert registry.resolve_backend_name() == "cpu"  # context beats env
        assert registry.resolve_backend_name("cpu") == "cpu"


def test_explicit_unavailable_backend_fails_with_the_reason():
    ok, reason = registry.get_backend("ascend").available()
    if ok:
        pytest.skip("ascend is available here")
    with pytest.raises(registry.BackendUnavailableError, match="ascend: " + reason.split("(")[0].strip()):
        muon.orthogonalize(torch.randn(4, 4), backend="ascend")
    with pytest.raises(registry.BackendUnavailableError):
        with glm5_core.use_backend("ascend"):
            pass


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="backend: expected"):
        muon.orthogonalize(torch.randn(4, 4), backend="tpu")


def test_strict_mode_turns_a_fallback_into_an_error_naming_the_op(monkeypatch, fresh_registry):
    from glm5_core import testing
    from glm5_core.ops import mla

    if "mla_decode" not in registry.missing_ops("cpu"):  # a reference by choice on cpu
        pytest.skip("cpu implements mla_decode natively")
    x = testing.make_mla_inputs(testing.MLA_SHAPES[1])
    mla.decode(**x, scale=0.5, backend="cpu")
    monkeypatch.setenv("GLM5_STRICT", "1")
    with pytest.raises(registry.BackendCoverageError, match="mla_decode"):
        mla.decode(**x, scale=0.5, backend="cpu")


def _fake_backend_module(tmp_path, module, supports_line="", kernel="Kernel(orthogonalize)", table=None):
    """A vendor 'vendorx' whose Muon kernel counts its calls; ``kernel`` is its table entry (a Kernel record,
    or the bare function as out-of-tree tables wrote it before records, with ``supports_line`` setting its
    function attributes); ``table`` replaces the whole kernel-table expression."""
    table = table or f"{{'muon_orthogonalize': {kernel}}}"
    pkg = tmp_path / module
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        import torch
        from glm5_core.registry import Backend, Kernel
        from glm5_core.ops import muon

        def orthogonalize(G, *, steps, coefficients):
            orthogonalize.calls += 1
            return muon.orthogonalize_reference(G, steps=steps, coefficients=coefficients)
        orthogonalize.calls = 0
        {supports_line}

        BACKEND = Backend(name="vendorx", device_type="cpu", dist_backend="gloo",
                          probe=lambda: (True, "simulated vendor"),
                          kernel_table=lambda: {table},
                          missing={{"moe_route": "vendorx has no router kernel yet"}})
    """))
    dist = tmp_path / "vendorx_glm5-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vendorx-glm5\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[glm5_core.backends]\nvendorx = {module}:BACKEND\n")
    return pkg


def test_third_party_backend_joins_through_the_entry_point(tmp_path, monkeypatch, fresh_registry):
    _fake_backend_module(tmp_path, "vendorx_glm5")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "vendorx" in registry.backends()
    import vendorx_glm5

    muon.orthogonalize(torch.randn(6, 4), backend="vendorx")
    assert vendorx_glm5.orthogonalize.calls == 1
    rows = {r.op: r for r in registry.explain("vendorx")}
    assert rows["muon_orthogonalize"].label.startswith("vendorx: vendorx_glm5.orthogonalize")
    assert rows["moe_route"].is_reference and rows["moe_route"].reason == "vendorx has no router kernel yet"


AT_MOST_4_COLUMNS = "lambda G, **kw: (G.shape[-1] <= 4, 'at most 4 columns')"


@pytest.mark.parametrize("form", ("record", "legacy_attribute"))
def test_a_kernel_can_decline_a_call_and_the_reference_runs(tmp_path, monkeypatch, fresh_registry, form):
    module = f"vendorx_declines_{form}"
    if form == "record":
        _fake_backend_module(tmp_path, module, kernel=f"Kernel(orthogonalize, supports={AT_MOST_4_COLUMNS})")
    else:  # a bare callable carrying the hook as a function attribute: wrapped, the attribute read
        _fake_backend_module(tmp_path, module, f"orthogonalize.supports = {AT_MOST_4_COLUMNS}", kernel="orthogonalize")
    monkeypatch.syspath_prepend(str(tmp_path))
    vendorx_declines = __import__(module)

    muon.orthogonalize(torch.randn(3, 8), backend="vendorx")
    assert vendorx_declines.orthogonalize.calls == 0
    muon.orthogonalize(torch.randn(8, 3), backend="vendorx")
    assert vendorx_declines.orthogonalize.calls == 1
    monkeypatch.setenv("GLM5_STRICT", "1")
    with pytest.raises(registry.BackendCoverageError, match="at most 4 columns"):
        muon.orthogonalize(torch.randn(3, 8), backend="vendorx")


def test_probes_are_cached():
    from glm5_core.backends.ascend.device import npu_probe
    from glm5_core.backends.cuda.device import gpu_probe

    assert npu_probe() is npu_probe()
    assert gpu_probe.cache_info().currsize >= 0
    with pytest.raises(ValueError, match="vendor"):
        gpu_probe("tpu")


def test_calls_needing_gradients_skip_kernels_without_a_backward(tmp_path, monkeypatch, fresh_registry):
    """The registry routes gradient calls: a kernel declared without a backward never sees one (its ``supports``
    is not even asked), one declared ``differentiable`` does."""
    _fake_backend_module(tmp_path, "vendorx_nograd", "def supports(G, **kw):\n"
                         "            supports.asked += 1\n"
                         "            return True, ''\n"
                         "        supports.asked = 0",
                         kernel="Kernel(orthogonalize, supports=supports)")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vendorx_nograd

    G = torch.randn(4, 6, requires_grad=True)
    out = muon.orthogonalize(G, backend="vendorx")
    assert vendorx_nograd.orthogonalize.calls == 0 and out.requires_grad  # the differentiable reference ran
    assert vendorx_nograd.supports.asked == 0
    with torch.no_grad():
        muon.orthogonalize(G, backend="vendorx")
    assert vendorx_nograd.orthogonalize.calls == 1 and vendorx_nograd.supports.asked == 1
    monkeypatch.setenv("GLM5_STRICT", "1")
    with pytest.raises(registry.BackendCoverageError, match="no backward"):
        muon.orthogonalize(G, backend="vendorx")


GRADIENT_FREE_TOPK = ("from glm5_core.ops import dsa\n"
                      "        def select(q, k, w, *, topk, start_pos=0):\n"
                      "            select.calls += 1\n"
                      "            return dsa.indexer_topk_reference(q, k, w, topk=topk, start_pos=start_pos)\n"
                      "        select.calls = 0")


def test_a_kernel_without_backward_takes_calls_whose_outputs_carry_no_gradient(tmp_path, monkeypatch,
                                                                               fresh_registry):
    """Top-k indices have no gradient: inputs that require grad must not send the call to the reference."""
    from glm5_core import testing
    from glm5_core.ops import dsa

    _fake_backend_module(tmp_path, "vendorx_topk", GRADIENT_FREE_TOPK, table="{'dsa_indexer_topk': Kernel(select)}")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vendorx_topk

    x = testing.make_indexer_inputs(testing.IndexerShape(B=1, T=5, S=5, H=2, D=8, K=3), seed=0)
    q, k, w = (x[n].requires_grad_(True) for n in ("q", "k", "w"))
    with registry.record_reference_runs() as ran:
        idx = dsa.indexer_topk(q, k, w, 3, backend="vendorx")
    assert vendorx_topk.select.calls == 1 and ran == [] and not idx.requires_grad
    assert registry.op_spec("dsa_indexer_topk").gradient_free


def test_reference_runs_are_recorded_whether_declined_or_without_a_kernel(tmp_path, monkeypatch, fresh_registry):
    _fake_backend_module(tmp_path, "vendorx_ran", kernel=f"Kernel(orthogonalize, supports={AT_MOST_4_COLUMNS})")
    monkeypatch.syspath_prepend(str(tmp_path))
    from glm5_core.ops import moe

    with registry.record_reference_runs() as ran:
        muon.orthogonalize(torch.randn(8, 3), backend="vendorx")  # the kernel
        muon.orthogonalize(torch.randn(3, 8), backend="vendorx")  # declined
        moe.route(torch.randn(4, 8), None, top_k=2, backend="vendorx")  # no kernel
    assert ran == [("muon_orthogonalize", "at most 4 columns"), ("moe_route", "vendorx has no router kernel yet")]


@pytest.mark.parametrize("form", ("record", "legacy_attribute"))
def test_a_differentiable_kernel_takes_gradient_calls(tmp_path, monkeypatch, fresh_registry, form):
    if form == "record":
        _fake_backend_module(tmp_path, f"vendorx_grad_{form}", kernel="Kernel(orthogonalize, differentiable=True)")
    else:
        _fake_backend_module(tmp_path, f"vendorx_grad_{form}", "orthogonalize.differentiable = True",
                             kernel="orthogonalize")
    monkeypatch.syspath_prepend(str(tmp_path))
    vendor = __import__(f"vendorx_grad_{form}")
    out = muon.orthogonalize(torch.randn(4, 6, requires_grad=True), backend="vendorx")
    assert vendor.orthogonalize.calls == 1 and out.requires_grad


def _with_detect(monkeypatch, detected):
    """Pretend the hardware of the backends named in ``detected`` is here (and no other's)."""
    import dataclasses

    known = {n: dataclasses.replace(b, detect=(lambda n=n: n in detected)) for n, b in registry.backends().items()}
    monkeypatch.setattr(registry, "_discover", lambda: known)


def test_auto_skips_hardware_whose_backend_cannot_run(monkeypatch):
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    _with_detect(monkeypatch, {"ascend", "cuda"})
    expected = next((n for n in ("ascend", "cuda") if registry.get_backend(n).available()[0]), "cpu")
    assert registry.resolve_backend_name() == expected


def test_auto_detection_selects_an_out_of_tree_backend_when_its_detect_says_so(tmp_path, monkeypatch, fresh_registry):
    """A toy vendor package installed through the entry point joins auto-detection by its own detect() and
    priority; when detect() says its hardware is absent, auto-detection passes it over."""
    pkg = tmp_path / "toyvendor_glm5"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import os
        from glm5_core.registry import Backend
        from glm5_core.ops import muon

        def orthogonalize(G, *, steps, coefficients):
            orthogonalize.calls += 1
            return muon.orthogonalize_reference(G, steps=steps, coefficients=coefficients)
        orthogonalize.calls = 0

        BACKEND = Backend(name="toyvendor", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "toy"),
                          kernel_table=lambda: {"muon_orthogonalize": orthogonalize},
                          detect=lambda: os.environ.get("TOY_DEVICE") == "1", priority=100)
    """))
    dist = tmp_path / "toyvendor_glm5-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toyvendor-glm5\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[glm5_core.backends]\ntoyvendor = toyvendor_glm5:BACKEND\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    monkeypatch.delenv("TOY_DEVICE", raising=False)
    assert "toyvendor" in registry.backends()
    assert registry.resolve_backend_name() != "toyvendor"
    monkeypatch.setenv("TOY_DEVICE", "1")
    assert registry.resolve_backend_name() == "toyvendor"
    import toyvendor_glm5

    muon.orthogonalize(torch.randn(5, 3))
    assert toyvendor_glm5.orthogonalize.calls == 1


def test_a_broken_detect_does_not_break_auto_detection(monkeypatch):
    import dataclasses

    def broken():
        raise RuntimeError("driver exploded")

    known = dict(registry.backends())
    known["brokenvendor"] = dataclasses.replace(known["cpu"], name="brokenvendor", detect=broken, priority=1000)
    monkeypatch.setattr(registry, "_discover", lambda: known)
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    assert registry.resolve_backend_name() in known and registry.resolve_backend_name() != "brokenvendor"


def test_a_plugin_cannot_replace_a_builtin_backend(tmp_path, monkeypatch, fresh_registry):
    pkg = tmp_path / "evil_glm5"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from glm5_core.registry import Backend
        BACKEND = Backend(name="cpu", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "evil"),
                          kernel_table=dict)
    """))
    dist = tmp_path / "evil_glm5-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil-glm5\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[glm5_core.backends]\ncpu = evil_glm5:BACKEND\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.get_backend("cpu").available()[1] != "evil"


def _fake_moe_backend(tmp_path, module, with_fused):
    """A vendor backend with a counting moe_combine kernel and, optionally, a fused kernel that declines."""
    pkg = tmp_path / module
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        from glm5_core.registry import Backend
        from glm5_core.ops import moe

        def combine(y_sorted, sort_idx, weights):
            combine.calls += 1
            return moe.combine_reference(y_sorted, sort_idx, weights)
        combine.calls = 0

        def fused(*args):
            fused.calls += 1
            return moe.fused_experts_reference(*args)
        fused.calls = 0
        fused.supports = lambda *args: (False, "only for experts of width 1000")

        TABLE = {{"moe_combine": combine}}
        if {with_fused}:
            TABLE["moe_fused_experts"] = fused
        BACKEND = Backend(name="vendorm", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "simulated"),
                          kernel_table=lambda: TABLE)
    """))
    dist = tmp_path / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[glm5_core.backends]\nvendorm = {module}:BACKEND\n")


def _moe_layer_args():
    from glm5_core import testing
    from glm5_core.ops import moe

    shape = testing.MOE_SHAPES[1]
    w = testing.make_expert_inputs(shape, seed=3)
    weights, ids = moe.route_reference(testing.make_route_inputs(shape, seed=4)["logits"], None, top_k=shape.K)
    return (w["x"], weights, ids, w["w_gate"], w["w_up"], w["w_down"])


@pytest.mark.parametrize("with_fused", (False, True))
def test_composite_runs_the_backends_own_parts(tmp_path, monkeypatch, fresh_registry, with_fused):
    """Without a fused kernel, or when the fused kernel declines a call, moe_fused_experts runs the backend's
    own dispatch / experts / combine (here: its counting combine), never the whole reference."""
    from glm5_core.ops import moe

    module = f"vendorm_{int(with_fused)}"
    _fake_moe_backend(tmp_path, module, with_fused)
    monkeypatch.syspath_prepend(str(tmp_path))
    vendor = __import__(module)
    fused_row = {r.op: r for r in registry.explain("vendorm")}["moe_fused_experts"]
    if with_fused:
        assert fused_row.label == f"vendorm: {module}.fused"
    else:
        assert fused_row.label == "vendorm: glm5_core.ops.moe.fused_experts_composite"
        assert "no fused kernel" in fused_row.reason
    args = _moe_layer_args()
    torch.testing.assert_close(moe.fused_experts(*args, backend="vendorm"), moe.fused_experts_reference(*args))
    assert vendor.combine.calls == 1 and vendor.fused.calls == 0
    assert not registry.runs_reference("moe_fused_experts", "vendorm") and "moe_fused_experts" not in \
        registry.missing_ops("vendorm")
    monkeypatch.setenv("GLM5_STRICT", "1")  # the composite is no fallback; its parts are, and strict names them
    with pytest.raises(registry.BackendCoverageError, match="moe_dispatch"):
        moe.fused_experts(*args, backend="vendorm")


def test_a_composite_whose_parts_all_fall_back_counts_as_reference(tmp_path, monkeypatch, fresh_registry):
    _fake_backend_module(tmp_path, "vendorx_noparts")  # only a Muon kernel
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.runs_reference("moe_fused_experts", "vendorx")
    assert "moe_fused_experts" in registry.missing_ops("vendorx")
    assert not registry.runs_reference("muon_orthogonalize", "vendorx")


def test_declined_calls_are_recorded_as_reference_fallbacks(tmp_path, monkeypatch, fresh_registry):
    """``record_fallbacks`` sees the calls a kernel declined (the reference ran), not those it took."""
    _fake_backend_module(tmp_path, "vendorx_recorded", kernel=f"Kernel(orthogonalize, supports={AT_MOST_4_COLUMNS})")
    monkeypatch.syspath_prepend(str(tmp_path))
    with registry.record_fallbacks() as declined:
        muon.orthogonalize(torch.randn(8, 3), backend="vendorx")
        assert declined == []
        muon.orthogonalize(torch.randn(3, 8), backend="vendorx")
        muon.orthogonalize(torch.randn(3, 8, requires_grad=True), backend="vendorx")
    assert declined == [("muon_orthogonalize", "at most 4 columns"),
                        ("muon_orthogonalize", "the kernel has no backward and this call needs gradients")]
    muon.orthogonalize(torch.randn(3, 8), backend="vendorx")  # outside the block: nothing more is recorded
    assert len(declined) == 2


def test_an_unknown_backend_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("GLM5_BACKEND", "tpu")
    with pytest.raises(ValueError, match="GLM5_BACKEND: expected 'auto' or one of cpu, .*got 'tpu'"):
        registry.resolve_backend_name()
    with pytest.raises(ValueError, match="^backend: expected"):  # the argument still names itself
        registry.resolve_backend_name("tpu")


def test_the_registry_tables_derive_from_the_op_declarations():
    specs = registry.op_specs()
    assert registry.OP_NAMES == tuple(specs)
    ops_at_e663cfe = ("mla_prefill", "mla_decode", "dsa_indexer_scores", "dsa_indexer_topk", "dsa_sparse_prefill",
                      "dsa_sparse_decode", "dsa_selected_index_scores", "dsa_sparse_prefill_expanded",
                      "dsa_selected_attention_target", "moe_route", "moe_dispatch", "moe_combine", "moe_experts",
                      "moe_fused_experts", "muon_orthogonalize")  # the 15 ops, in order (a new op needs no edit here)
    assert tuple(name for name in registry.OP_NAMES if name in ops_at_e663cfe) == ops_at_e663cfe
    for name, target in registry.REFERENCES.items():
        assert registry._import_target(target) is specs[name].reference is registry.reference(name)
    assert dict(registry.COMPOSITE_PARTS) == {"moe_fused_experts": ("moe_dispatch", "moe_experts", "moe_combine"),
                                              "ep_experts": ("ep_dispatch", "moe_experts", "ep_combine")}
    assert registry._import_target(registry.COMPOSITES["moe_fused_experts"]) is specs["moe_fused_experts"].composite
    with pytest.raises(AttributeError, match="NO_SUCH_TABLE"):
        _ = registry.NO_SUCH_TABLE


def test_op_declarations_are_checked(monkeypatch, fresh_registry):
    with pytest.raises(ValueError, match="declares both composite and parts"):
        registry.OpSpec("foo_bar", len, family="moe", parts=("moe_dispatch",))
    with pytest.raises(TypeError, match="foo_bar: reference: expected a callable"):
        registry.OpSpec("foo_bar", "glm5_core.ops.foo:bar_reference", family="foo")
    from glm5_core.ops import muon as muon_family

    monkeypatch.setattr(muon_family, "OPS", muon_family.OPS * 2)
    registry.reset()
    with pytest.raises(ValueError, match="glm5_core.ops.muon.OPS: op 'muon_orthogonalize' is declared twice"):
        registry.op_specs()
    monkeypatch.setattr(muon_family, "OPS", (registry.OpSpec("muon_bad", len, family="muon", composite=len,
                                                             parts=("no_such_op",)),))
    registry.reset()
    with pytest.raises(ValueError, match="muon_bad: parts: expected declared ops, got unknown"):
        registry.op_specs()


def test_unbound_calls_honour_the_context_and_the_environment_bound_calls_keep_their_backend(
        tmp_path, monkeypatch, fresh_registry):
    """Resolutions are cached per (op, backend name), yet a call without a binding still follows use_backend and
    GLM5_BACKEND as they change; a Binding keeps the backend it was made for."""
    _fake_backend_module(tmp_path, "vendorx_resolution")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vendorx_resolution

    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    G = torch.randn(4, 3)
    on_cpu = registry.bind("cpu")
    with glm5_core.use_backend("vendorx"):
        on_vendor = registry.bind()
        muon.orthogonalize(G)
        assert vendorx_resolution.orthogonalize.calls == 1
        muon.orthogonalize(G, backend=on_cpu)  # bound elsewhere: not moved by the context
        assert vendorx_resolution.orthogonalize.calls == 1
    muon.orthogonalize(G)  # the context is gone: auto-detection (cpu)
    assert vendorx_resolution.orthogonalize.calls == 1
    monkeypatch.setenv("GLM5_BACKEND", "vendorx")
    muon.orthogonalize(G)
    assert vendorx_resolution.orthogonalize.calls == 2
    monkeypatch.setenv("GLM5_BACKEND", "cpu")
    muon.orthogonalize(G)
    muon.orthogonalize(G, backend=on_vendor)
    assert vendorx_resolution.orthogonalize.calls == 3 and on_vendor.backend == "vendorx"
    assert repr(on_vendor) == "Binding('vendorx')" and registry.bind(on_vendor) is on_vendor


def test_reset_forgets_cached_resolutions(tmp_path, monkeypatch, fresh_registry):
    """Resolutions are cached per (op, backend name) until ``reset()``: a kernel table that changed (a plug-in
    upgraded at run time) is seen after it, not before."""
    _fake_backend_module(tmp_path, "vendorx_late", "TABLE = {}",
                         table="{'muon_orthogonalize': Kernel(orthogonalize)} if TABLE else {}")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vendorx_late

    assert registry.resolve("muon_orthogonalize", "vendorx").is_reference
    vendorx_late.TABLE["ready"] = True
    assert registry.resolve("muon_orthogonalize", "vendorx").is_reference  # cached
    registry.reset()
    assert registry.resolve("muon_orthogonalize", "vendorx").label == "vendorx: vendorx_late.orthogonalize"


def test_a_bound_reference_fallback_obeys_strict_mode_at_call_time(monkeypatch):
    from glm5_core import testing
    from glm5_core.ops import mla

    if not registry.runs_reference("mla_decode", "cpu"):
        pytest.skip("cpu implements mla_decode natively")
    bound = registry.bind("cpu")  # binding is not a call: strict mode does not stop it
    x = testing.make_mla_inputs(testing.MLA_SHAPES[1])
    monkeypatch.setenv("GLM5_STRICT", "1")
    registry.bind("cpu")
    with pytest.raises(registry.BackendCoverageError, match="mla_decode"):
        mla.decode(**x, scale=0.5, backend=bound)
