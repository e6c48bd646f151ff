"""KDA decode step on cpu: the native kernels (csrc/cpu_kda.cpp through glm5_core/backends/cpu/kda_native.py) against
the torch path that ran before them (the references ``kda.recurrent_reference`` and
``kda.causal_conv_update_reference``: the cpu backend had no kernel for these ops), one token (T = 1) from a state,
q / k l2-normalised in the op as GLM-5.3 calls it, fp32, the conv over the layer's 3 H K q / k / v channels (W = 4).
Both sides are called as kernel functions (the entry point's validation and the registry lookup, the same for both,
are left out); the native entry point ``kda.recurrent(..., backend="cpu")`` is timed too. Interleaved rounds (who
goes first alternates), each round the mean of ``--calls`` calls, medians over rounds; wall and process CPU time.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_kda_decode.py --threads 1 \
        --out benchmarks/results/kda_cpu_native.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _results import write_json  # benchmarks/, the script's folder

from glm5_core import registry, testing
from glm5_core.backends.cpu import kda_native
from glm5_core.ops import kda

# (label, B, H, K = V): small heads (H = 4, K = V = 64) at batch 1 and 8; GLM5Config.tiny_glm53()'s KDA layers
# (configs/tiny_glm53.yaml: linear_num_heads 4, linear_head_dim 16) at batch 1 and 8; GLM-5.3-Flash (the GLM5Config
# defaults: 64 heads of 128) at batch 1
CASES = {"h4k64-b1": ("H4 K64 B=1", 1, 4, 64), "h4k64-b8": ("H4 K64 B=8", 8, 4, 64),
         "tiny-b1": ("tiny_glm53 B=1", 1, 4, 16), "tiny-b8": ("tiny_glm53 B=8", 8, 4, 16),
         "flash-b1": ("flash B=1", 1, 64, 128)}


def _time(fn, calls: int) -> tuple[float, float]:
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls, (time.process_time() - cpu_start) / calls


def _case(label: str, B: int, H: int, K: int, rounds: int, calls: int) -> dict:
    shape = testing.KDAShape(B, 1, H, K, K)
    x = testing.make_kda_inputs(shape, seed=0)
    c = testing.make_conv_inputs(shape, seed=1)
    step = (c["x"][:, 0], c["conv_state"], c["weight"])
    impls = {
        "recurrent/torch": lambda: kda.recurrent_reference(**x, output_final_state=True, use_qk_l2norm=True),
        "recurrent/native": lambda: kda_native.recurrent(**x, output_final_state=True, use_qk_l2norm=True),
        "recurrent/native entry point": lambda: kda.recurrent(**x, output_final_state=True, use_qk_l2norm=True,
                                                              backend="cpu"),
        "conv_update/torch": lambda: kda.causal_conv_update_reference(*step),
        "conv_update/native": lambda: kda_native.causal_conv_update(*step),
    }
    ro, rs = impls["recurrent/torch"]()
    no, ns = impls["recurrent/native"]()
    co, cs = impls["conv_update/torch"]()
    nco, ncs = impls["conv_update/native"]()
    diff = {"recurrent": max(float((no - ro).abs().max()), float((ns - rs).abs().max())),
            "conv_update": max(float((nco - co).abs().max()), float((ncs - cs).abs().max()))}
    wall = {k: [] for k in impls}
    cpu = {k: [] for k in impls}
    order = list(impls.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            w, p = _time(fn, calls)
            wall[name].append(w)
            cpu[name].append(p)
    med = {k: statistics.median(v) for k, v in wall.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    step_torch = med["recurrent/torch"] + med["conv_update/torch"]
    step_native = med["recurrent/native"] + med["conv_update/native"]
    out = {"case": label, "B": B, "H": H, "K": K, "V": K, "conv_channels": 3 * H * K, "median_wall_s": med,
           "median_cpu_s": cpu_med, "wall_s": wall, "max_abs_diff": diff,
           "speedup_wall": {"recurrent": med["recurrent/torch"] / med["recurrent/native"],
                            "conv_update": med["conv_update/torch"] / med["conv_update/native"],
                            "decode_step": step_torch / step_native},
           "speedup_cpu_time": {"recurrent": cpu_med["recurrent/torch"] / cpu_med["recurrent/native"],
                                "conv_update": cpu_med["conv_update/torch"] / cpu_med["conv_update/native"]}}
    us = {k: v * 1e6 for k, v in med.items()}
    print(f"{label} (H={H} K=V={K}): recurrent torch {us['recurrent/torch']:.1f} us, native "
          f"{us['recurrent/native']:.1f} us ({out['speedup_wall']['recurrent']:.2f}x; entry point "
          f"{us['recurrent/native entry point']:.1f} us); conv update torch {us['conv_update/torch']:.1f} us, native "
          f"{us['conv_update/native']:.1f} us ({out['speedup_wall']['conv_update']:.2f}x); step "
          f"{out['speedup_wall']['decode_step']:.2f}x; max |diff| {diff['recurrent']:.1e} / {diff['conv_update']:.1e}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=50, help="calls per round (the Flash case: a fifth of it)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="default: all")
    parser.add_argument("--out", default="benchmarks/results/kda_cpu_native.json")
    args = parser.parse_args(argv)
    for name in ("rounds", "calls", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    for op in ("kda_recurrent", "kda_causal_conv_update"):
        if registry.runs_reference(op, "cpu"):
            print(f"cpu runs the reference for {op} (native extension not built): nothing to compare",
                  file=sys.stderr)
            return 1
    results = [_case(label, B, H, K, args.rounds, args.calls if H < 64 else max(1, args.calls // 5))
               for label, B, H, K in (CASES[name] for name in args.cases)]
    write_json(args.out, {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                          "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                          "load_average": os.getloadavg(), "rounds": args.rounds, "calls": args.calls,
                          "cases": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
