"""The vendors' dtype limits: Enflame's int32-only top-k (bitwise equal to the reference, no int64 tensor made), the
gcu kernel table and its fallback reasons under GLM5_STRICT=1, and the no-fp64 vendors judged against a CPU fp64
reference with their fp64 checks skipped (one line)."""
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5_core import registry, testing
from glm5_core.backends import simulated
from glm5_core.backends.gcu import dsa as gcu_dsa
from glm5_core.conformance import check as conformance_check
from glm5_core.conformance import cli as conformance_cli
from glm5_core.conformance.families import checks
from glm5_core.ops import dsa
from tests.backends.vendors.conftest import NEW_VENDORS


class _OutputDtypes(TorchDispatchMode):
    """Records the dtype of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


SHAPES = [testing.IndexerShape(B=2, T=3, S=20, H=2, D=16, K=5), testing.IndexerShape(B=1, T=4, S=33, H=3, D=8, K=40),
          testing.IndexerShape(B=2, T=1, S=64, H=1, D=8, K=64)]


@pytest.mark.parametrize("ties", testing.TIE_MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_int32_only_topk_is_bitwise_the_reference(shape, ties):
    x = testing.make_indexer_inputs(shape, seed=3, ties=ties)
    for start in (shape.S - shape.T, torch.tensor([0, shape.S - shape.T])[:shape.B], 0):
        want = dsa.indexer_topk_reference(x["q"], x["k"], x["w"], topk=shape.K, start_pos=start)
        got = gcu_dsa.indexer_topk(x["q"], x["k"], x["w"], topk=shape.K, start_pos=start)
        assert got.dtype == torch.int32 and torch.equal(got, want), (ties, start)


def test_the_selection_makes_no_int64_tensor_and_folds_negative_zero():
    scores = torch.tensor([[[0.0, -0.0, 1.5, -2.0, float("-inf"), 1.5, -0.0]]])
    with _OutputDtypes() as seen:
        got = gcu_dsa.topk_int32(scores, 5, 6)
    assert torch.int64 not in seen.dtypes, seen.dtypes
    assert torch.equal(got, dsa._topk_from_scores(scores, 5, 6))
    assert got.tolist() == [[[2, 5, 0, 1, 6]]]  # +0.0 and -0.0 tie: lower index first
    with pytest.raises(ValueError, match="overflowed to NaN"):
        gcu_dsa.topk_int32(torch.tensor([[[0.0, float("nan")]]]), 1, 1)


def test_the_gcu_table_on_its_simulated_device_and_strict_mode_names_every_fallback(monkeypatch):
    shape = SHAPES[0]
    x = testing.make_indexer_inputs(shape, seed=5, ties="duplicate_keys")
    with simulated.simulate("gcu", interpret=False) as status:
        assert status.startswith("simulated 8 x Enflame S60")
        assert registry.get_backend("gcu").device() == "cpu"
        got = dsa.indexer_topk(x["q"], x["k"], x["w"], shape.K, start_pos=shape.S - shape.T, backend="gcu")
        assert torch.equal(got, dsa.indexer_topk_reference(x["q"], x["k"], x["w"], topk=shape.K,
                                                           start_pos=shape.S - shape.T))
        rows = {r.op: r for r in registry.explain("gcu")}
        assert rows["dsa_indexer_topk"].label == "gcu: glm5_core.backends.gcu.dsa.indexer_topk"
        fallbacks = [r for r in rows.values() if r.is_reference]
        assert fallbacks and all("int64" in r.reason for r in fallbacks)
        monkeypatch.setenv("GLM5_STRICT", "1")
        for r in fallbacks:
            with pytest.raises(registry.BackendCoverageError, match=f"^{r.op}: .*GLM5_STRICT=1"):
                registry.resolve(r.op, "gcu")
        with pytest.raises(registry.BackendCoverageError, match="dsa_indexer_topk: gcu declines .*fp64"):
            dsa.indexer_topk(x["q"].double(), x["k"].double(), x["w"].double(), shape.K, backend="gcu")
    assert registry.get_backend("gcu").device() == "gcu"


def test_vendors_without_fp64_skip_their_fp64_checks_and_are_judged_on_the_cpu():
    no_fp64 = [v for v in NEW_VENDORS if not registry.get_backend(v).facts.supports(torch.float64)]
    assert set(no_fp64) == {"musa", "mlu", "kunlunxin"}
    assert not registry.get_backend("gcu").facts.supports(torch.int64)
    fp64_checks = [c.name for c in checks("mla") if torch.float64 in conformance_check.check_dtypes(c)]
    assert len(fp64_checks) == 3 and all("[fp64-" in name for name in fp64_checks)
    for vendor in NEW_VENDORS:
        facts = registry.get_backend(vendor).facts
        skipped = [c.name for c in checks("mla") if conformance_cli._skipped(c, facts)]
        assert skipped == (fp64_checks if vendor in no_fp64 else [])
    # the fp64 reference of inputs on such a device runs on the CPU; elsewhere where the inputs are
    assert conformance_check.reference_device(types.SimpleNamespace(type="mlu")) == torch.device("cpu")
    assert conformance_check.reference_device(torch.device("cpu")) == torch.device("cpu")
    with simulated.simulate_stack(simulated.stack_of("kunlunxin")):
        assert conformance_check.reference_device(torch.device("cuda", 0)) == torch.device("cpu")
    with simulated.simulate_stack(simulated.stack_of("metax")):
        assert conformance_check.reference_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    x = {"a": torch.ones(2, dtype=torch.bfloat16), "i": torch.arange(2, dtype=torch.int32)}
    y = conformance_check.fp64(x)
    assert (y["a"].dtype, y["i"].dtype) == (torch.float64, torch.int32)
