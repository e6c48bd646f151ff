"""In-process A/B of ``glm5_core.ops._checks.finite``: this tree's against a base tree's, on one input with and
without ``requires_grad``, interleaved call by call (wall time, perf_counter, one thread, medians).

    git archive BASE glm5_core/ops/_checks.py | tar -x -C /tmp/base
    python benchmarks/finite_check_ab.py --base /tmp/base/glm5_core/ops/_checks.py --rounds 1000
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from glm5_core.ops import _checks


def _base_finite(path: str):
    spec = importlib.util.spec_from_file_location("base_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.finite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base tree's glm5_core/ops/_checks.py")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--shape", default="8,128,4,16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fns = {"old": _base_finite(args.base), "new": _checks.finite}
    shape = tuple(int(n) for n in args.shape.split(","))
    for requires_grad in (False, True):
        x = torch.randn(shape, requires_grad=requires_grad) * 1.0  # a non-leaf when it requires grad
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                start = time.perf_counter_ns()
                fn("x", x)
                times[name].append(time.perf_counter_ns() - start)
        med = {name: statistics.median(v) / 1e3 for name, v in times.items()}
        print(f"shape {shape} requires_grad={requires_grad}: old {med['old']:.1f} us, new {med['new']:.1f} us, "
              f"new / old {med['new'] / med['old']:.3f} ({args.rounds} interleaved rounds, medians)")


if __name__ == "__main__":
    main()
