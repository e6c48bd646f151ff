"""Conformance of every backend under test for the determinism family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("determinism"), ids=str)
def test_determinism(backend, check):
    conformance.assert_conforms(backend, check)


def _random_tie_topk(q, k, w, topk, *, start_pos=0):
    """The reference's selection with ties broken in a random order (as a top-k built on atomics may)."""
    import torch

    from glm5_core.ops import dsa

    scores_BTS = dsa.indexer_scores_reference(q, k, w, start_pos=start_pos)
    perm_S = torch.randperm(scores_BTS.shape[-1])
    order = perm_S[torch.sort(scores_BTS[..., perm_S], dim=-1, descending=True, stable=True).indices]
    order = order[..., :topk]  # [B, T, <=topk]
    picked = torch.gather(scores_BTS, -1, order)
    idx = torch.where(torch.isinf(picked), -1, order).to(torch.int32)
    pad = topk - idx.shape[-1]
    return torch.cat([idx, idx.new_full((*idx.shape[:-1], pad), -1)], dim=-1) if pad > 0 else idx


def test_the_checks_catch_a_topk_that_breaks_ties_at_random(monkeypatch):
    import torch

    from glm5_core import registry
    from glm5_core.conformance import determinism

    known = registry.backends()
    fake = registry.Backend(name="randomties", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "test"),
                            kernel_table=lambda: {"dsa_indexer_topk": _random_tie_topk})
    monkeypatch.setattr(registry, "_discover", lambda: {**known, "randomties": fake})
    torch.manual_seed(0)
    verdicts = {name: fn("randomties", "cpu").passed for name, fn in determinism.CHECKS.items()}
    registry._kernel_table.cache_clear()
    caught = [n for n in ("topk_batch_invariance_ties", "topk_prefill_decode_zero_relu") if not verdicts[n]]
    assert caught == ["topk_batch_invariance_ties", "topk_prefill_decode_zero_relu"], verdicts
    assert verdicts["route_batch_invariance"]  # the router is the reference here


def _cache_length_dependent_topk(q, k, w, topk, *, start_pos=0):
    """The reference's selection, with scores rounded differently for short caches (as a kernel that switches
    GEMM algorithms with the key count does): fp64 then fp32 below 16 keys, fp32 from there on."""
    from glm5_core.ops import dsa

    if k.shape[1] >= 16:
        return dsa.indexer_topk_reference(q, k, w, topk=topk, start_pos=start_pos)
    scores_BTS = dsa.indexer_scores_reference(q.double(), k.double(), w.double(), start_pos=start_pos).float()
    return dsa._topk_from_scores(scores_BTS, topk, start_pos)


def test_the_near_tie_check_catches_a_topk_whose_rounding_depends_on_the_cache_length(monkeypatch):
    from glm5_core import registry
    from glm5_core.conformance import determinism

    known = registry.backends()
    fake = registry.Backend(name="cachelength", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "test"),
                            kernel_table=lambda: {"dsa_indexer_topk": _cache_length_dependent_topk})
    monkeypatch.setattr(registry, "_discover", lambda: {**known, "cachelength": fake})
    verdicts = {name: fn("cachelength", "cpu").passed for name, fn in determinism.CHECKS.items()}
    registry._kernel_table.cache_clear()
    assert not verdicts["topk_prefill_decode_near_ties"], verdicts
    assert determinism.CHECKS["topk_prefill_decode_near_ties"]("cpu", "cpu").passed


def test_backward_repeatability_catches_gradients_that_change_between_runs():
    import torch

    from glm5_core.conformance import determinism

    runs = iter(range(10))

    def drifting_grads(backend, device, dtype):  # as a backward accumulating with atomics in a varying order may
        return [torch.ones(3, dtype=dtype), torch.full((2,), 1.0 + next(runs) * 2.0 ** -20, dtype=dtype)]

    result = determinism.backward_repeatability(drifting_grads, torch.float32, "cpu", "cpu")
    assert not result.passed and "backward run 1 differs" in result.detail
    steady = determinism.backward_repeatability(lambda *a: [torch.ones(3)], torch.float32, "cpu", "cpu")
    assert steady.passed


def _random_tie_kpool_topk(q, k, w, gate, ape, *, topk, kpool, select_tail, scale, start_pos=0):
    """The k-pool reference with tied pools ordered at random (pools, then the shared expansion)."""
    import torch

    from glm5_core.ops import kpool_topk

    pooled = kpool_topk.pool_keys(k, gate, ape, kpool)
    scores = kpool_topk.kpool_scores_reference(q, pooled, w, scale=scale, start_pos=start_pos, kpool=kpool)
    perm = torch.randperm(scores.shape[-1])
    order = perm[torch.sort(scores[..., perm], dim=-1, descending=True, stable=True).indices]
    order = order[..., :min(topk // kpool, scores.shape[-1])]
    order = torch.where(torch.isinf(torch.gather(scores, -1, order)), -1, order)
    return kpool_topk.expand(order, start_pos, topk=topk, kpool=kpool, select_tail=select_tail)


def test_the_kpool_checks_catch_a_kpool_topk_that_breaks_ties_at_random(monkeypatch):
    import torch

    from glm5_core import registry
    from glm5_core.conformance import determinism

    known = registry.backends()
    fake = registry.Backend(name="randomkpool", device_type="cpu", dist_backend="gloo", probe=lambda: (True, "test"),
                            kernel_table=lambda: {"dsa_kpool_topk": _random_tie_kpool_topk})
    monkeypatch.setattr(registry, "_discover", lambda: {**known, "randomkpool": fake})
    torch.manual_seed(0)
    verdicts = {name: fn("randomkpool", "cpu").passed for name, fn in determinism.CHECKS.items()
                if name.startswith("kpool_")}
    registry._kernel_table.cache_clear()
    assert not verdicts["kpool_topk_batch_invariance_ties"] and not verdicts["kpool_topk_prefill_decode_zero_relu"]
    assert verdicts["kpool_topk_prefill_decode"], verdicts  # no ties there: the random order never shows
