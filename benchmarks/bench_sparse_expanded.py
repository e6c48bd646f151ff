"""Sparse MLA prefill, forward + backward on cpu: the expanded form (``dsa.sparse_prefill_expanded``, per-head keys)
vs the absorbed form (``dsa.sparse_prefill``, latent rows), at the training config's head sizes.

Both compute the same attention over the same selected keys (causal top-k style indices, -1 padded); interleaved
rounds, medians. The expanded inputs are the latent ones expanded once (what the model's kv_b_proj does, not timed).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_sparse_expanded.py --rounds 7 \\
        --out benchmarks/results/sparse_expanded.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _results import write_json  # benchmarks/, the script's folder

from glm5_core import testing
from glm5_core.ops import dsa


def _timers(B: int, T: int, K: int, heads, forward_only: bool):
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

    timers = {"absorbed fwd": infer(dsa.sparse_prefill, latent),
              "expanded fwd": infer(dsa.sparse_prefill_expanded, expanded)}
    if not forward_only:
        timers.update({"absorbed fwd+bwd": train(dsa.sparse_prefill, latent),
                       "expanded fwd+bwd": train(dsa.sparse_prefill_expanded, expanded)})
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["2x512x128", "1x4096x256"], help="BATCHxTOKENSxTOPK")
    parser.add_argument("--heads", default="8,32,16,32,128",
                        help="H,Dn,Dr,Dv,C (default: bench_train_vs_transformers' model; bench_kernelize's: "
                             "8,96,32,128,256)")
    parser.add_argument("--forward-only", action="store_true", help="inference only (kernelize's prefill)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for case in args.cases:
        B, T, K = (int(v) for v in case.split("x"))
        timers = _timers(B, T, K, tuple(int(v) for v in args.heads.split(",")), args.forward_only)
        for fn in timers.values():  # warm-up
            fn()
        times = {name: [] for name in timers}
        for _ in range(args.rounds):
            for name, fn in timers.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) for name, v in times.items()}
        row = {"case": case, "heads": args.heads, "median_s": med, "times_s": times,
               "fwd_speedup": med["absorbed fwd"] / med["expanded fwd"]}
        text = f"{case} (H,Dn,Dr,Dv,C {args.heads}):"
        if not args.forward_only:
            row["fwd_bwd_speedup"] = med["absorbed fwd+bwd"] / med["expanded fwd+bwd"]
            text += (f" fwd+bwd absorbed {med['absorbed fwd+bwd'] * 1e3:.0f} ms, expanded "
                     f"{med['expanded fwd+bwd'] * 1e3:.0f} ms ({row['fwd_bwd_speedup']:.2f}x);")
        rows.append(row)
        print(f"{text} fwd absorbed {med['absorbed fwd'] * 1e3:.0f} ms, expanded {med['expanded fwd'] * 1e3:.0f} ms "
              f"({row['fwd_speedup']:.2f}x)")
    if args.out:
        result = {"command": "python benchmarks/bench_sparse_expanded.py " + " ".join(sys.argv[1:]),
                  "rounds": args.rounds, "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
                  "cases": rows}
        write_json(args.out, result, shown={})


if __name__ == "__main__":
    main()
