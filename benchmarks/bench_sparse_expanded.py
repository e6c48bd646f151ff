"""Sparse MLA prefill, forward + backward on cpu: the expanded form (``dsa.sparse_prefill_expanded``, per-head keys)
vs the absorbed form (``dsa.sparse_prefill``, latent rows), at the training config's head sizes.

Both compute the same attention over the same selected keys (causal top-k style indices, -1 padded); interleaved
rounds, medians. The expanded inputs are the latent ones expanded once (what the model's kv_b_proj does, not timed).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_sparse_expanded.py --rounds 7 \\
        --out benchmarks/results/sparse_expanded.json

``--base-tree DIR``: instead, the expanded form of this tree's native extension ("new") against a base tree's ("old",
``benchmarks/_base_extension.py``), interleaved, after checking that the outputs and gradients are bitwise equal:

    mkdir -p /tmp/base && git archive BASE | tar -x -C /tmp/base      # BASE: the commit to compare against
    python benchmarks/bench_sparse_expanded.py --base-tree /tmp/base --threads 1 --heads 4,16,8,16,32 \\
        --cases 8x128x32
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _results import write_json  # benchmarks/, the script's folder

from glm5_core import testing
from glm5_core.ops import dsa


def _timers(B: int, T: int, K: int, heads, forward_only: bool, base_tree=None):
    H, Dn, Dr, Dv, C = heads
    shape = testing.MLAShape(B=B, T=T, S=T, H=H, Dn=Dn, Dr=Dr, Dv=Dv, C=C)
    latent = testing.make_sparse_inputs(shape, K, seed=1, start_pos=0)
    expanded = testing.make_sparse_expanded_inputs(shape, K, seed=1, start_pos=0)
    idx = latent.pop("topk_idx")
    expanded.pop("topk_idx")
    scale = (shape.Dn + shape.Dr) ** -0.5

    def train(entry, inputs):
        def step():
            leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
            entry(**leaves, topk_idx=idx, scale=scale, backend="cpu").sum().backward()
        return step

    def infer(entry, inputs):
        def step():
            with torch.no_grad():
                entry(**inputs, topk_idx=idx, scale=scale, backend="cpu")
        return step

    if base_tree is not None:
        return _base_timers(train, infer, expanded, idx, scale, forward_only)
    timers = {"absorbed fwd": infer(dsa.sparse_prefill, latent),
              "expanded fwd": infer(dsa.sparse_prefill_expanded, expanded)}
    if not forward_only:
        timers.update({"absorbed fwd+bwd": train(dsa.sparse_prefill, latent),
                       "expanded fwd+bwd": train(dsa.sparse_prefill_expanded, expanded)})
    return timers


def _base_timers(train, infer, expanded, idx, scale, forward_only: bool):
    """old / new expanded timers (the base tree's kernels and this tree's), once checked bitwise equal."""
    import _base_extension  # benchmarks/, the script's folder

    def traced(variant):
        with _base_extension.kernels(variant):
            leaves = {k: v.clone().requires_grad_() for k, v in expanded.items()}
            out = dsa.sparse_prefill_expanded(**leaves, topk_idx=idx, scale=scale,
                                              backend="cpu")
            out.backward(torch.ones_like(out).cumsum(-1))  # a grad_out that differs between the elements
        return [out] + [leaves[k].grad for k in sorted(leaves)]

    if not all(torch.equal(a, b) for a, b in zip(traced("old"), traced("new"))):
        raise SystemExit("bench_sparse_expanded: the base and this tree's kernels differ (not bitwise equal)")

    def under(variant, fn):
        def step():
            with _base_extension.kernels(variant):
                fn()
        return step

    timers = {}
    for variant in ("old", "new"):
        timers[f"{variant} expanded fwd"] = under(variant, infer(dsa.sparse_prefill_expanded, expanded))
        if not forward_only:
            timers[f"{variant} expanded fwd+bwd"] = under(variant, train(dsa.sparse_prefill_expanded, expanded))
    return timers


def _ratios(med) -> dict:
    """new / old of each timer pair (base mode), else absorbed / expanded (the expanded form's speed-up)."""
    if "old expanded fwd" in med:
        return {f"{p} new/old": med[f"new expanded {p}"] / med[f"old expanded {p}"]
                for p in ("fwd", "fwd+bwd") if f"old expanded {p}" in med}
    return {f"{p} absorbed/expanded": med[f"absorbed {p}"] / med[f"expanded {p}"]
            for p in ("fwd", "fwd+bwd") if f"absorbed {p}" in med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["2x512x128", "1x4096x256"], help="BATCHxTOKENSxTOPK")
    parser.add_argument("--heads", default="8,32,16,32,128",
                        help="H,Dn,Dr,Dv,C (default: bench_train_vs_transformers' model; bench_kernelize's: "
                             "8,96,32,128,256)")
    parser.add_argument("--forward-only", action="store_true", help="inference only (kernelize's prefill)")
    parser.add_argument("--base-tree", type=Path, default=None,
                        help="time this tree's expanded kernels against this base tree's (old / new)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.base_tree is not None:
        import _base_extension  # benchmarks/, the script's folder

        _base_extension.build(args.base_tree)
    rows = []
    for case in args.cases:
        B, T, K = (int(v) for v in case.split("x"))
        timers = _timers(B, T, K, tuple(int(v) for v in args.heads.split(",")), args.forward_only, args.base_tree)
        for fn in timers.values():  # warm-up
            fn()
        times = {name: [] for name in timers}
        for r in range(args.rounds):
            for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):  # A B ..., then ... B A
                t0 = time.perf_counter()
                timers[name]()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) for name, v in times.items()}
        row = {"case": case, "heads": args.heads, "median_s": med, "times_s": times, "ratios": _ratios(med)}
        rows.append(row)
        shown = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in med.items())
        ratios = ", ".join(f"{name} {v:.3f}" for name, v in row["ratios"].items())
        print(f"{case} (H,Dn,Dr,Dv,C {args.heads}), wall-time medians of {args.rounds} rounds: {shown}; {ratios}")
    if args.out:
        result = {"command": "python benchmarks/bench_sparse_expanded.py " + " ".join(sys.argv[1:]),
                  "rounds": args.rounds, "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
                  "cases": rows}
        write_json(args.out, result, shown={})


if __name__ == "__main__":
    main()
