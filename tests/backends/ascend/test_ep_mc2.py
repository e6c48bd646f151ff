"""The ascend fused ``ep_experts`` kernel (npu_alltoallv_gmm + SwiGLU + npu_gmm_alltoallv + the fp32 slot-order
combine) on the executable statement of the documented semantics (tests/backends/ascend/mc2_vendor_semantics.py),
8 simulated ranks (threads; 8 is the smallest documented ep_world_size) in one process: each rank's output is
bitwise the one-device routed FFN computed with the vendor's GEMM rounding (gate / up and down outputs in bf16),
and within the tolerance table of the contract's reference (as conformance judges the slot); each documented
limit is a named decline."""
import re
import threading

import pytest
import torch

from glm5_core import testing
from glm5_core.backends.ascend import ep_mc2
from glm5_core.ops import moe
from tests.backends.ascend.mc2_vendor_semantics import MC2World

WORLD, E, K, D, F = 8, 16, 2, 128, 16


def _inputs(seed=0, T=4600):
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for r in range(WORLD):
        xs.append(torch.randn(T + 16 * r, D, generator=g).to(torch.bfloat16))
        n = xs[-1].shape[0]
        first = torch.randint(0, E, (n,), generator=g)
        second = (first + torch.randint(1, E, (n,), generator=g)) % E  # distinct from the first
        ids.append(torch.stack([first, second], 1).to(torch.int32))
        ws.append(torch.rand(n, K, generator=g))
    w_gate = (torch.randn(E, F, D, generator=g) / 8).to(torch.bfloat16)
    w_up = (torch.randn(E, F, D, generator=g) / 8).to(torch.bfloat16)
    w_down = (torch.randn(E, D, F, generator=g) / 4).to(torch.bfloat16)
    return xs, ids, ws, (w_gate, w_up, w_down)


def _places(ids, soc="A3"):
    L_ = E // WORLD
    sent = [int(i.numel()) for i in ids]
    counts = torch.stack([torch.bincount(i.reshape(-1).long(), minlength=E) for i in ids])  # [N, E]
    received = [int(counts[:, r * L_:(r + 1) * L_].sum()) for r in range(WORLD)]
    return [ep_mc2.MC2Place(rank=r, world=WORLD, comm_name="hccl_ep", soc=soc, device="Ascend910_9391",
                            min_sent=min(sent), max_sent=max(sent), min_received=min(received),
                            max_received=max(received)) for r in range(WORLD)]


class _CountExchange:
    """The reference's count exchange among the simulated ranks (a barrier where all_to_all_single runs)."""

    def __init__(self):
        self.barrier = threading.Barrier(WORLD, timeout=60)
        self.posted = [None] * WORLD

    def for_rank(self, rank):
        def exchange(send):  # send [N, L] -> recv [N, L]: row s = what source s sends this rank
            self.posted[rank] = send
            self.barrier.wait()
            recv = torch.stack([self.posted[s][rank] for s in range(WORLD)])
            self.barrier.wait()
            return recv
        return exchange


def _run(xs, ids, ws, weights, places):
    sim, counts = MC2World(WORLD), _CountExchange()
    L_ = E // WORLD
    results, errors = [None] * WORLD, []

    def rank_main(r):
        try:
            sl = slice(r * L_, (r + 1) * L_)
            with torch.inference_mode():
                results[r] = ep_mc2.experts(xs[r], ids[r], ws[r], *(w[sl] for w in weights), group=None,
                                            num_experts=E, npu=sim.ops(r), place=places[r],
                                            exchange=counts.for_rank(r))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            sim.barrier.abort()
            counts.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, sim


def _vendor_rounded_ffn(x, ids, w, weights):
    """The one-device routed FFN with the documented ops' rounding: per expert, its rows in the contract's order,
    gate / up product rounded to bf16, SwiGLU in fp32 rounded to bf16, down product rounded to bf16; combine in
    fp32 in slot order."""
    w_gate, w_up, w_down = weights
    x_sorted, sort_idx, counts = moe.dispatch_reference(x, ids, num_experts=E)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x_sorted[start:start + n]
        gate_up = torch.cat([w_gate[e], w_up[e]]).T  # [D, 2F]
        h = (rows.float() @ gate_up.float()).to(torch.bfloat16)
        hidden = moe.swiglu(h[:, :F].float(), h[:, F:].float()).to(torch.bfloat16)
        outs.append((hidden.float() @ w_down[e].T.float()).to(torch.bfloat16))
        start += n
    return moe.combine_reference(torch.cat(outs), sort_idx, w)


def test_mc2_experts_on_eight_ranks_are_the_routed_ffn():
    xs, ids, ws, weights = _inputs()
    places = _places(ids)
    with torch.inference_mode():
        assert ep_mc2.limits(xs[0], ids[0], *(w[:2] for w in weights), E, places[0]) == (True, "")
    results, sim = _run(xs, ids, ws, weights, places)
    assert sim.calls.count("npu_alltoallv_gmm") == WORLD and sim.calls.count("npu_gmm_alltoallv") == WORLD
    x, i, w = torch.cat(xs), torch.cat(ids), torch.cat(ws)
    exact = _vendor_rounded_ffn(x, i, w, weights)
    contract = moe.fused_experts_reference(x, w, i, *weights)
    fp64 = moe.fused_experts_reference(x.double(), w.double(), i, *(t.double() for t in weights))
    start = 0
    for r in range(WORLD):
        n = xs[r].shape[0]
        got = results[r]
        assert got.dtype == torch.bfloat16 and got.shape == (n, D)
        assert torch.equal(got, exact[start:start + n]), f"rank {r}: not the routed FFN with the vendor rounding"
        verdict = testing.compare_to_fp64(got, contract[start:start + n], fp64[start:start + n], torch.bfloat16)
        assert verdict.passed, f"rank {r}: {verdict.detail}"  # the tolerance table, as conformance judges ep_experts
        start += n


def _small(dtype=torch.bfloat16, T=4, K_=2, D_=D, F_=F):
    x = torch.zeros(T, D_, dtype=dtype)
    ids = torch.stack([torch.arange(K_)] * T).to(torch.int32)
    return x, ids, torch.zeros(2, F_, D_, dtype=dtype), torch.zeros(2, F_, D_, dtype=dtype), \
        torch.zeros(2, D_, F_, dtype=dtype)


def _place(world=WORLD, soc="A3", sent=(9000, 9000), received=(9000, 9000)):
    return ep_mc2.MC2Place(rank=0, world=world, comm_name="c", soc=soc, device=f"{soc}-device", min_sent=sent[0],
                           max_sent=sent[1], min_received=received[0], max_received=received[1])


@pytest.mark.parametrize("case,match", [
    (dict(), "rollout only"),
    (dict(place=_place(soc="A2")), "Atlas A3 only"),
    (dict(place=_place(soc=None)), "Atlas A3 only"),
    (dict(place=_place(world=4)), "ep_world_size in 8/16/32/64, got 4"),
    (dict(args=_small(torch.float32)), "float16/bfloat16, got x torch.float32"),
    (dict(num_experts=8 * 33), "e <= 32 experts a card"),
    (dict(args=_small(K_=1)), r"top-k K in \[2, 8\], got K=1"),
    (dict(args=_small(K_=9)), r"got K=9"),
    (dict(args=_small(D_=65536, F_=1)), r"H \(hidden size\) = 65536"),
    (dict(args=_small(F_=32768)), r"2F \(gate and up\) = 65536"),
    (dict(place=_place(sent=(0, 9000))), r"BSK \(rows a card sends\)"),
    (dict(place=_place(received=(0, 9000))), "A = 0"),
    (dict(place=_place(sent=(100, 9000))), r"\[2 MB, 100 MB\], got 25600 to"),
    (dict(place=_place(received=(9000, 500000))), r"\[2 MB, 100 MB\]"),
])
def test_each_documented_limit_is_a_named_decline(case, match):
    args = case.get("args", _small())
    num_experts = case.get("num_experts", E)
    place = case.get("place", _place())
    if match == "rollout only":  # training: decided before anything else
        ok, why = ep_mc2.limits(*args[:2], *args[2:], num_experts, place)
    else:
        with torch.inference_mode():
            ok, why = ep_mc2.limits(*args[:2], *args[2:], num_experts, place)
    assert not ok and "\n" not in why
    assert re.search(match, why), why


def test_supports_declines_training_and_cpu_tensors_without_a_collective():
    x, ids, wg, wu, wd = _small()
    ok, why = ep_mc2._supports(x, ids, torch.zeros(4, 2), wg, wu, wd, group=None, num_experts=E)
    assert not ok and "training runs dispatch, the experts and combine over HCCL" in why
    with torch.inference_mode():
        ok, why = ep_mc2._supports(x, ids, torch.zeros(4, 2), wg, wu, wd, group=None, num_experts=E)
    assert not ok and "no expert-parallel group" in why


def test_backends_listing_says_when_the_vendor_kernels_run():
    from glm5_core import registry
    from glm5_core.kernel import Kernel

    reasons = {r.op: r for r in registry.explain("ascend", require=False)}
    assert reasons["ep_experts"].label == "ascend: glm5_core.backends.ascend.ep_mc2.experts"
    assert "rollout only" in reasons["ep_experts"].reason and "Atlas A3" in reasons["ep_experts"].reason
    for op in ("ep_dispatch", "ep_combine"):
        assert "training runs the reference over HCCL" in reasons[op].reason
    with pytest.raises(TypeError, match="note: expected a str, got int"):
        Kernel(len, note=1)
