"""The native DSA kernels with H <= 4 heads (packed: two keys per 8-lane vector) against a base tree's, in one process.

First a bitwise check, ``torch.equal`` on every output, of this tree's kernels against the base tree's
(``benchmarks/_base_extension.py``) over odd shapes: H 1-5, K 1 / odd / past the keys, -1 slots, rows with no key,
repeated keys, fp32 / bf16 keys, 1 and 2 threads: ``sparse_expanded_forward`` (out, lse), ``sparse_expanded_backward``
(every gradient) and ``selected_attention_target`` (both normalisers). Then each kernel at the tiny preset's shapes
(``GLM5Config.tiny()``: B 8, T = S 128, 4 heads, nope 16 + rope 8, v 16, top-k 32), old and new interleaved (A B, then
B A), ``--calls`` calls a sample, process time, medians of ``--rounds`` samples, one thread.

    mkdir -p /tmp/base && git archive BASE | tar -x -C /tmp/base      # BASE: the commit to compare against
    python benchmarks/bench_packed_heads_ab.py --base-tree /tmp/base --rounds 21
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def _sparse_case(B, T, S, H, Dn, R, Dv, K, seed, key_dtype):
    g = torch.Generator().manual_seed(seed)
    q_nope, q_pe = torch.randn(B, T, H, Dn, generator=g), torch.randn(B, T, H, R, generator=g)
    k_nope = torch.randn(B, S, H, Dn, generator=g).to(key_dtype)
    k_pe, v = torch.randn(B, S, R, generator=g).to(key_dtype), torch.randn(B, S, H, Dv, generator=g).to(key_dtype)
    idx = torch.randint(-1, S, (B, T, K), generator=g)
    idx[:, 0] = -1  # rows with no key
    idx[-1, -1, -1] = idx[-1, -1, 0]  # a repeated key
    return (q_nope, q_pe, k_nope, k_pe, v, idx), torch.randn(B, T, H, Dv, generator=g)


def _sparse_outputs(ops, args, grad_out, scale):
    out, lse = ops.sparse_expanded_forward(*args, scale)
    return (out, lse) + tuple(ops.sparse_expanded_backward(grad_out, *args, out, lse, scale))


def _target_case(B, T, S, H, Dn, R, K, seed, causal):
    g = torch.Generator().manual_seed(seed)
    q_nope, q_pe = torch.randn(B, T, H, Dn, generator=g), torch.randn(B, T, H, R, generator=g)
    k_nope, k_pe = torch.randn(B, S, H, Dn, generator=g), torch.randn(B, S, R, generator=g)
    lse = torch.rand(B, T, H, generator=g) * 4 + 2 if causal else torch.empty(0)
    idx = torch.randint(-1, S, (B, T, K), generator=g)
    idx[:, 0] = -1
    start = torch.randint(0, max(1, S - T + 1), (B,), generator=g)
    return q_nope, q_pe, k_nope, k_pe, lse, idx, start


def check_bitwise(old, new) -> int:
    """The number of cases compared; raises AssertionError naming the first that differs."""
    shapes = ((1, 1, 1, 8, 4, 8), (2, 7, 11, 5, 3, 7), (1, 9, 9, 17, 9, 19), (2, 33, 300, 16, 8, 16))
    cases = 0
    for H, (B, T, S, Dn, R, Dv), K, threads in itertools.product((1, 2, 3, 4, 5), shapes, (1, 20, 37), (1, 2)):
        torch.set_num_threads(threads)
        for key_dtype in (torch.float32, torch.bfloat16):
            args, grad_out = _sparse_case(B, T, S, H, Dn, R, Dv, K, cases, key_dtype)
            for i, (a, b) in enumerate(zip(_sparse_outputs(old, args, grad_out, 0.3),
                                           _sparse_outputs(new, args, grad_out, 0.3))):
                assert torch.equal(a, b), f"sparse_expanded output {i} differs: H {H}, {(B, T, S, Dn, R, Dv)}, K {K}"
            cases += 1
        for causal in (False, True):
            args = _target_case(B, T, S, H, Dn, R, K, cases, causal)
            a, b = old.selected_attention_target(*args, 0.3), new.selected_attention_target(*args, 0.3)
            assert torch.equal(a, b), f"selected_attention_target differs: H {H}, {(B, T, S, Dn, R)}, K {K}"
            cases += 1
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-tree", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    import _base_extension  # benchmarks/, the script's folder

    from glm5_core.backends.cpu import extension

    _base_extension.build(args.base_tree)
    old, new = getattr(torch.ops, _base_extension.BASE_NAMESPACE), getattr(torch.ops, extension.NAMESPACE)
    print(f"bitwise equal: {check_bitwise(old, new)} cases (every output torch.equal)")

    torch.set_num_threads(1)
    B, T, H, Dn, R, Dv, K = 8, 128, 4, 16, 8, 16, 32
    scale = (Dn + R) ** -0.5
    sparse, grad_out = _sparse_case(B, T, T, H, Dn, R, Dv, K, 0, torch.float32)
    sparse = sparse[:5] + (torch.stack([torch.randperm(T)[:K] for _ in range(B * T)]).view(B, T, K),)
    out, lse = old.sparse_expanded_forward(*sparse, scale)
    selected = _target_case(B, T, T, H, Dn, R, K, 1, False)[:5] + (sparse[5], torch.zeros(B, dtype=torch.long))
    causal = _target_case(B, T, T, H, Dn, R, K, 1, True)[:5] + (sparse[5], torch.zeros(B, dtype=torch.long))
    kernels = {"sparse_expanded_forward": lambda ops: ops.sparse_expanded_forward(*sparse, scale),
               "sparse_expanded_backward": lambda ops: ops.sparse_expanded_backward(grad_out, *sparse, out, lse,
                                                                                    scale),
               "selected_attention_target (selected)": lambda ops: ops.selected_attention_target(*selected, scale),
               "selected_attention_target (causal)": lambda ops: ops.selected_attention_target(*causal, scale)}
    print(f"B {B}, T = S {T}, H {H}, Dn {Dn}, R {R}, Dv {Dv}, K {K}, 1 thread; process time per call, medians of "
          f"{args.rounds} rounds x {args.calls} calls, old and new interleaved; load average {os.getloadavg()}")
    for name, call in kernels.items():
        results = [call(ops) for ops in (old, new)]
        results = [r if isinstance(r, tuple) else (r,) for r in results]  # the outputs of each
        assert all(torch.equal(a, b) for a, b in zip(*results)), name
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            for variant in (("old", "new") if r % 2 == 0 else ("new", "old")):
                ops = old if variant == "old" else new
                t0 = time.process_time()
                for _ in range(args.calls):
                    call(ops)
                times[variant].append((time.process_time() - t0) / args.calls)
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        pairs = statistics.median(n / o for o, n in zip(times["old"], times["new"]))
        print(f"  {name}: old {med['old']:.3f} ms, new {med['new']:.3f} ms, new/old {med['new'] / med['old']:.3f} "
              f"(median of the per-round ratios {pairs:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
