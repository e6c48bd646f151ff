"""The kernel benchmarks of ``benchmarks/gpu/bench_kernels.py`` for one vendor's Triton backend, on its simulated
device when asked (``--simulate``: the vendor stack's documented surface on this host, the kernels interpreted on CPU
tensors, tiny shapes): the FLOP counts are the cases', the times are the interpreter's and say nothing about the
hardware. The header records ``simulated``.

    python benchmarks/vendor/simulated_bench.py musa --simulate --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import bench_kernels  # noqa: E402  (benchmarks/gpu)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", help="the vendor backend (musa, mlu, kunlunxin, metax, hygon, ...)")
    parser.add_argument("--simulate", action="store_true", help="on the backend's simulated device")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    from glm5_core import registry
    from glm5_core.backends import simulated

    name = registry.resolve_backend_name(args.backend)
    with (simulated.simulate(name) if args.simulate else contextlib.nullcontext("")) as status:
        registry.require_available(name)
        extra = ["--tiny", "--reps", "2", "--simulated", status] if args.simulate else []
        return bench_kernels.main(["--backend", name, "--out", str(args.out), "--budget-s", str(args.budget_s),
                                   *extra])


if __name__ == "__main__":
    sys.exit(main())
