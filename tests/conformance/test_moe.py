"""Conformance of every backend under test for the moe family (checks defined in glm5_core.conformance.moe), and
the dispatch check comparing dtypes."""
import pytest
import torch

from glm5_core import conformance, registry


@pytest.mark.parametrize("check", conformance.checks("moe"), ids=str)
def test_moe(backend, check):
    conformance.assert_conforms(backend, check)


def test_conformance_compares_dispatch_dtypes(monkeypatch):
    """torch.equal ignores dtypes: a dispatch that returns int32 counts must still fail its check."""
    from glm5_core.ops import moe

    def dispatch(x, expert_ids, *, num_experts):
        x_sorted, sort_idx, counts = moe.dispatch_reference(x, expert_ids, num_experts=num_experts)
        return x_sorted, sort_idx, counts.to(torch.int32)

    known = registry.backends()
    fake = registry.Backend(name="int32counts", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "test"),
                            kernel_table=lambda: {"moe_dispatch": dispatch})
    monkeypatch.setattr(registry, "_discover", lambda: {**known, "int32counts": fake})
    try:
        results = [conformance.run_check(c, "int32counts") for c in conformance.checks("moe") if "dispatch" in c.name]
    finally:
        registry._kernel_table.cache_clear()
    assert results and all(r.status == "fail" and "counts is torch.int32" in r.detail for r in results)
