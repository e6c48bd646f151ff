"""The sparse stage's indexer scores at the selected keys, forward and backward: reference vs the cpu kernel.

``dsa_selected_index_scores`` at the training benchmark's indexer shape (batch 2 x 512 queries, 8 heads x 64,
index_topk 128, keys from the native top-k), fp32. Each round times both implementations (forward, then the
backward of a fixed cotangent on the selected slots), in an order that rotates every round; medians.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_selected_index_scores.py --rounds 7 \\
        --out benchmarks/results/selected_index_scores.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _results import write_json  # benchmarks/, the script's folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/selected_index_scores.json")
    args = parser.parse_args(argv)
    for name in ("batch", "tokens", "topk", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if args.topk > args.tokens:
        parser.error(f"--topk: expected at most --tokens ({args.tokens}), got {args.topk}")
    from glm5_core import registry, testing
    from glm5_core.backends.cpu import dsa as native_dsa
    from glm5_core.ops import dsa

    torch.set_num_threads(args.threads)
    if registry.runs_reference("dsa_selected_index_scores", "cpu"):
        print("the cpu backend runs the reference for dsa_selected_index_scores (extension not built)", file=sys.stderr)
        return 1
    shape = testing.IndexerShape(B=args.batch, T=args.tokens, S=args.tokens, H=8, D=64, K=args.topk)
    x = testing.make_indexer_inputs(shape, seed=1)
    idx = dsa.indexer_topk(x["q"], x["k"], x["w"], args.topk, backend="cpu")
    cotangent = torch.randn(idx.shape, generator=torch.Generator().manual_seed(2)).masked_fill(idx < 0, 0.0)
    impls = {"reference": dsa.selected_index_scores_reference, "cpu": native_dsa.selected_index_scores}

    def run(fn):
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "w")]
        start = time.perf_counter()
        out = fn(*leaves, idx)
        mid = time.perf_counter()
        out.masked_fill(idx < 0, 0.0).backward(cotangent)
        return mid - start, time.perf_counter() - mid

    names = list(impls)
    for name in names:
        run(impls[name])  # warm-up
    times = {n: {"forward": [], "backward": []} for n in names}
    for r in range(args.rounds):
        for name in names[r % 2:] + names[:r % 2]:
            fwd, bwd = run(impls[name])
            times[name]["forward"].append(fwd)
            times[name]["backward"].append(bwd)
    med = {n: {p: statistics.median(v) for p, v in t.items()} for n, t in times.items()}
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "shape": str(shape),
              "threads": args.threads, "rounds": args.rounds, "load_average": os.getloadavg(), "median_s": med,
              "times_s": times, "speedup": {p: med["reference"][p] / med["cpu"][p] for p in ("forward", "backward")}}
    write_json(args.out, result)
    for p in ("forward", "backward"):
        print(f"{p}: reference {1e3 * med['reference'][p]:.1f} ms, cpu {1e3 * med['cpu'][p]:.1f} ms "
              f"({result['speedup'][p]:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
