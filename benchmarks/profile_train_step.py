"""Where one training step of bench_train_vs_transformers' glm5 model goes: dense vs sparse, attention vs the rest.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/profile_train_step.py --tokens 4096 --topk 256

Profiles one glm5 dense step and one sparse step (with the sparse stage's indexer KL, selected-keys target, no
recall) after two untimed warm-up steps and two timed ones each, and splits each profile's self CPU time into the
attention-specific ops (torch's flash attention for dense; the DSA kernels for sparse) and everything else (the
work both steps share). The dense step's total over its shared work bounds what any sparse attention can gain.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import bench_train_vs_transformers as bench
import torch
from torch.profiler import ProfilerActivity, profile

ATTENTION_OPS = ("flash_attention", "glm5_cpu::sparse", "glm5_cpu::indexer", "glm5_cpu::selected")


def _split(step) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    attention = {e.key: e.self_cpu_time_total / 1e6 for e in events if any(s in e.key for s in ATTENTION_OPS)}
    return {"wall_s": wall, "self_cpu_s": total, "attention_s": sum(attention.values()),
            "shared_s": total - sum(attention.values()), "attention_ops": attention}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=256)
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.topk < 1:
        parser.error(f"--tokens / --topk: expected positive integers, got {args.tokens} / {args.topk}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        hf, ours = bench._build(args.topk, folder)
        ids = torch.randint(0, bench.MODEL["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(1))
        steps = bench._steps(hf, ours, ids, "selected", False)
        names = ("glm5_dense", "glm5_sparse")
        timed = {name: [] for name in names}
        for rnd in range(3):
            for name in names:
                start = time.perf_counter()
                steps[name]()
                if rnd:
                    timed[name].append(time.perf_counter() - start)
        print("timed steps (s):", {k: [round(x, 3) for x in v] for k, v in timed.items()})
        split = {name: _split(steps[name]) for name in names}
    for name, s in split.items():
        print(f"{name}: wall {s['wall_s']:.3f} s, profiled self CPU {s['self_cpu_s']:.3f} s = attention "
              f"{s['attention_s']:.3f} + shared {s['shared_s']:.3f}")
        for op, secs in sorted(s["attention_ops"].items(), key=lambda kv: -kv[1]):
            print(f"    {op:60s} {secs:.3f}")
    dense = split["glm5_dense"]
    print(f"bound: a free sparse attention would make the step {dense['self_cpu_s'] / dense['shared_s']:.2f}x the "
          f"dense step at most")
    return 0


if __name__ == "__main__":
    sys.exit(main())
