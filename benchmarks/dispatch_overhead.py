"""Per-call cost of the registry's dispatch, on the cpu backend, for an op whose kernel does almost nothing.

The op is ``muon_orthogonalize`` with one Newton-Schulz step on a 2 x 2 matrix; its cpu kernel runs in a few
microseconds, so the differences between the variants are the dispatch:

  * kernel: the cpu kernel function called directly (no registry);
  * bound: ``registry.call`` with a ``Binding`` (what the model's layers and Muon do since they bind at
    construction);
  * by_name: ``registry.call(..., backend="cpu")``;
  * auto: ``registry.call(...)`` with no backend (context, GLM5_BACKEND, auto-detection per call).

Rounds are interleaved (every variant once per round, ``--calls`` calls each) and the medians reported, in
microseconds per call. Runs on code without ``registry.bind`` too (the "bound" variant is then left out).

    python benchmarks/dispatch_overhead.py --out benchmarks/results/dispatch_overhead.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _results import write_json

from glm5_core import registry
from glm5_core.ops import muon


def variants():
    G = torch.randn(2, 2)
    schedule = muon.coefficients_for("jordan")
    kernel = registry.resolve("muon_orthogonalize", "cpu").impl
    found = {
        "kernel": lambda: kernel(G, steps=1, coefficients=schedule),
        "by_name": lambda: registry.call("muon_orthogonalize", G, steps=1, coefficients=schedule, backend="cpu"),
        "auto": lambda: registry.call("muon_orthogonalize", G, steps=1, coefficients=schedule),
    }
    if hasattr(registry, "bind"):
        binding = registry.bind("cpu")
        found["bound"] = lambda: registry.call("muon_orthogonalize", G, steps=1, coefficients=schedule,
                                               backend=binding)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = variants()
    for fn in runs.values():  # warm up: extension load, first resolutions
        fn()
    samples = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    medians = {name: round(statistics.median(v), 2) for name, v in samples.items()}
    result = {"command": " ".join(["python"] + sys.argv), "rounds": args.rounds, "calls_per_round": args.calls,
              "median_us_per_call": medians,
              "median_dispatch_us": {n: round(m - medians["kernel"], 2) for n, m in medians.items() if n != "kernel"}}
    if args.out:
        write_json(args.out, result)
    else:
        print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
