"""Every Triton vendor's kernel table, at the cost of one interpreted run per distinct launch configuration (six
vendors must not multiply the interpreted kernels): the table serves the shared kernels in its own custom-op
namespace, ``GLM5_STRICT=1`` names every op it leaves to the reference, and the vendors are grouped by their
effective tiles (the launch numbers the interpreter executes; ``num_warps`` and compiler knobs change nothing
here): a group whose tiles the cuda / rocm tests of this folder already run is covered by them, any other group runs
the indexer top-k once, against cuda bit for bit. The new vendors are available under the interpreter only on their
(simulated) device, so the suite's backend-parametrized tests do not run them again; each vendor's full suite runs on
its simulated device with ``glm5 conformance --backend <vendor> --simulate`` (benchmarks/vendor/run.sh), outside
this suite."""
import pytest
import torch

from glm5_core import registry, testing
from glm5_core.backends import simulated
from tests.backends.triton.helpers import kernel, triton_vendor_configs

COVERED = ("cuda", "rocm")  # their tiles are run by the tests of this folder and tests/backends/rocm


def tiles(vendor: str) -> tuple:
    from glm5_core.backends.triton.table import launches

    return tuple(sorted((family, tuple(sorted(config.blocks.items())))
                        for family, config in launches(triton_vendor_configs()[vendor]).items()))


def groups() -> dict[tuple, list[str]]:
    found: dict[tuple, list[str]] = {}
    for vendor in sorted(triton_vendor_configs()):
        found.setdefault(tiles(vendor), []).append(vendor)
    return found


@pytest.mark.parametrize("vendor", sorted(set(triton_vendor_configs()) - set(COVERED)))
def test_the_vendor_table_serves_the_shared_kernels_and_strict_mode_names_each_fallback(vendor, monkeypatch):
    assert not registry.get_backend(vendor).available()[0]  # the interpreter alone does not make it available
    with simulated.simulate(vendor):
        _check_table(vendor, monkeypatch)
    registry.reset()


def _check_table(vendor, monkeypatch):
    mine = {r.op: r for r in registry.explain(vendor)}
    nvidia = {r.op: r for r in registry.explain("cuda")}
    assert {op for op, r in mine.items() if not r.is_reference} == {op for op, r in nvidia.items()
                                                                    if not r.is_reference}
    assert mine["moe_experts"].label.startswith(f"{vendor}: glm5_core.backends.triton.moe_experts")
    assert f"torch.ops.glm5_{vendor}.indexer_topk" in mine["dsa_indexer_topk"].label  # its own op namespace
    monkeypatch.setenv("GLM5_STRICT", "1")
    for op, r in mine.items():
        if r.is_reference:
            assert r.reason
            with pytest.raises(registry.BackendCoverageError, match=f"^{op}: .*GLM5_STRICT=1"):
                registry.resolve(op, vendor)


def test_each_distinct_launch_configuration_runs_once(device):
    covered = {tiles(v) for v in COVERED}
    x = testing.make_indexer_inputs(testing.IndexerShape(B=2, T=3, S=70, H=2, D=16, K=9), device=device,
                                    ties="duplicate_keys")
    want = kernel("dsa_indexer_topk", "cuda")(x["q"], x["k"], x["w"], topk=9, start_pos=67)
    ran = []
    for group, vendors in groups().items():
        if group in covered:
            continue
        with simulated.simulate(vendors[0]):
            got = kernel("dsa_indexer_topk", vendors[0])(x["q"], x["k"], x["w"], topk=9, start_pos=67)
        assert torch.equal(got, want), vendors
        ran.append(vendors[0])
    assert len(ran) == len(set(groups()) - covered)  # one run per group the cuda / rocm tests do not run
