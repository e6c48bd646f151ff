"""Issue 32's GLM-5.3 ops on the cpu backend, one run each (no JSON; the figures are quoted in
benchmarks/results/glm53_ops.md): the memory ``mhc_sinkhorn`` keeps for its backward (autograd's reference vs the
cpu kernel), the clamped SwiGLU's cost in the native fused experts, the k-pool top-k (reference vs native).

    PYTHONPATH=$PWD python benchmarks/glm53_ops_measure.py
"""
from __future__ import annotations

import time

import torch

from glm5_core.ops import dsa, mhc, moe
from glm5_core.ops.kpool_topk import kpool_topk_reference


def saved_bytes(fn):
    """(fn(), bytes autograd saves for its backward)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def best(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def sinkhorn(R: int = 4096, N: int = 4, iters: int = 20) -> None:
    logits = torch.randn(R, N, N, requires_grad=True)
    calls = {"reference": lambda: mhc.sinkhorn_reference(logits, iters=iters, eps=1e-6),
             "cpu kernel": lambda: mhc.sinkhorn(logits, iters=iters, eps=1e-6, backend="cpu")}
    for name, call in calls.items():
        _, nbytes = saved_bytes(call)
        seconds = best(lambda call=call: call().sum().backward())
        print(f"mhc_sinkhorn R={R} N={N} iters={iters} {name}: saved for backward {nbytes / 2**20:.2f} MiB, "
              f"fwd+bwd {seconds * 1e3:.1f} ms")


def clamped_experts(N: int = 1024, D: int = 256, F: int = 128, E: int = 16, K: int = 2) -> None:
    x, w = torch.randn(N, D) * 2, torch.rand(N, K)
    wg, wu, wd = torch.randn(E, F, D) * 0.2, torch.randn(E, F, D) * 0.2, torch.randn(E, D, F) * 0.1
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)]).int()
    for limit in (None, 1.0):
        leaves = [t.clone().requires_grad_() for t in (x, w, wg, wu, wd)]

        def step(leaves=leaves, limit=limit):
            out = moe.fused_experts(leaves[0], leaves[1], ids, *leaves[2:], swiglu_limit=limit, backend="cpu")
            out.sum().backward()

        print(f"moe_fused_experts N={N} D={D} F={F} E={E} K={K} swiglu_limit={limit}: cpu native fwd+bwd "
              f"{best(step) * 1e3:.1f} ms")


def kpool(T: int = 2048, H: int = 8, D: int = 64, pool: int = 16, topk: int = 256) -> None:
    q, k, w = torch.randn(1, T, H, D), torch.randn(1, T, D), torch.rand(1, T, H)
    gate, ape = torch.randn(1, T, D), torch.randn(pool, D)
    ref = best(lambda: kpool_topk_reference(q, k, w, gate, ape, topk=topk, kpool=pool, select_tail=True,
                                            scale=D ** -0.5), 3)
    native = best(lambda: dsa.kpool_topk(q, k, w, gate, ape, topk=topk, kpool=pool, backend="cpu"), 3)
    print(f"dsa_kpool_topk B=1 T=S={T} H={H} D={D} kpool={pool} topk={topk}: reference {ref * 1e3:.1f} ms, "
          f"cpu native {native * 1e3:.1f} ms ({ref / native:.2f}x)")


if __name__ == "__main__":
    torch.manual_seed(0)
    sinkhorn()
    clamped_experts()
    kpool()
