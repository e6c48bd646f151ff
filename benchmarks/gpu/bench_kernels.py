"""Benchmark every cuda-backend kernel against the reference and torch baselines; report achieved
TFLOP/s and GB/s against the device peaks; write JSON + Markdown results.

    python benchmarks/gpu/bench_kernels.py --out benchmarks/results           # on the GPU
    TRITON_INTERPRET=1 python benchmarks/gpu/bench_kernels.py --tiny --out /tmp  # CPU smoke run

Times are medians of CUDA-event-timed calls after warm-up (wall clock on CPU). A case or an
implementation that fails is recorded with its error, never silently dropped. ``--budget-s`` stops
starting new cases once spent, so the whole script fits its time box.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402  (sibling module)

# Dense peaks per device (vendor datasheets): bf16 tensor-core, fp32 (non tensor-core), HBM bytes/s.
DEVICE_PEAKS = {
    "H200": {"bf16": 989e12, "fp32": 67e12, "hbm": 4.8e12},
    "H100": {"bf16": 989e12, "fp32": 67e12, "hbm": 3.35e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12, "hbm": 2.0e12},
}


def device_peaks(device: str) -> dict[str, float]:
    if device != "cuda":
        return {}
    name = torch.cuda.get_device_name(0)
    for key, peaks in DEVICE_PEAKS.items():
        if key in name:
            return dict(peaks, name=name)
    return {"name": name}


def time_call(fn, device: str, reps: int, warmup: int, target_ms: float = 1500.0) -> float:
    """Median milliseconds of ``fn()``; slow calls get fewer repetitions (at least 3) to stay near target_ms."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    samples = []
    for _ in range(max(3, min(reps, int(target_ms / max(first_ms, 1e-3))))):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def measured_peaks(device: str) -> dict[str, float]:
    """What this device reaches on a large bf16 GEMM and a large copy (a sanity anchor for the table)."""
    if device != "cuda":
        return {}
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    gemm_ms = time_call(lambda: a @ a, device, reps=10, warmup=3)
    buf = torch.empty(2 ** 30, device=device, dtype=torch.uint8)
    dst = torch.empty_like(buf)
    copy_ms = time_call(lambda: dst.copy_(buf), device, reps=10, warmup=3)
    return {"bf16_gemm": 2 * 8192 ** 3 / (gemm_ms * 1e-3), "copy": 2 * buf.numel() / (copy_ms * 1e-3)}


def run_case(build, device: str, tiny: bool, reps: int, peaks: dict[str, float]) -> dict:
    case = build(device, tiny)
    row = {"case": case.name, "shape": case.shape, "flops": case.flops, "bytes": case.bytes, "impls": {}}
    for label, fn in case.impls.items():
        try:
            ms = time_call(fn, device, reps=reps, warmup=2)
        except Exception as exc:  # record, keep going
            row["impls"][label] = {"error": repr(exc)[:300]}
            continue
        entry = {"ms": ms, "tflops": case.flops / (ms * 1e-3) / 1e12, "gbps": case.bytes / (ms * 1e-3) / 1e9}
        if case.compute_dtype in peaks and case.flops:
            entry["pct_flop_peak"] = 100 * case.flops / (ms * 1e-3) / peaks[case.compute_dtype]
        if "hbm" in peaks:
            entry["pct_hbm_peak"] = 100 * case.bytes / (ms * 1e-3) / peaks["hbm"]
        row["impls"][label] = entry
    ours = next(iter(case.impls))
    if "ms" in row["impls"].get(ours, {}):
        row["speedup_of_ours"] = {label: e["ms"] / row["impls"][ours]["ms"]
                                  for label, e in row["impls"].items() if "ms" in e and label != ours}
    return row


def markdown(rows: list[dict], header: dict) -> str:
    simulated = f" (SIMULATED: {header['simulated']})" if header.get("simulated") else ""
    lines = [f"# {header.get('backend', 'cuda')} backend kernels on {header.get('device_name', header['device'])}"
             f"{simulated}", "",
             f"command: `{header['command']}`", f"peaks: {header['peaks']}", f"measured: {header['measured']}", "",
             "| case | shape | implementation | ms | TFLOP/s | GB/s | % FLOP peak | % HBM peak | ours is x faster |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['case']} | | error: {row['error']} | | | | | | |")
            continue
        for label, e in row["impls"].items():
            if "error" in e:
                lines.append(f"| {row['case']} | {row['shape']} | {label} | error: {e['error']} | | | | | |")
                continue
            speed = row.get("speedup_of_ours", {}).get(label, "")
            lines.append(f"| {row['case']} | {row['shape']} | {label} | {e['ms']:.3f} | {e['tflops']:.2f} | "
                         f"{e['gbps']:.1f} | {e.get('pct_flop_peak', float('nan')):.1f} | "
                         f"{e.get('pct_hbm_peak', float('nan')):.1f} | {speed if speed == '' else f'{speed:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU interpreter smoke run)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no new case after this many seconds")
    parser.add_argument("--only", nargs="*", default=None, help="case builder names, e.g. indexer_case")
    parser.add_argument("--skip", nargs="*", default=(), help="case builder names not to run")
    parser.add_argument("--backend", default="cuda",
                        help="the Triton backend whose kernels are timed (default cuda; benchmarks/vendor/run.sh "
                             "passes its vendor, on its simulated device)")
    parser.add_argument("--simulated", default="", help="what the device is simulated as (recorded in the header)")
    args = parser.parse_args(argv)
    before = os.environ.get("GLM5_BENCH_BACKEND")
    os.environ["GLM5_BENCH_BACKEND"] = args.backend  # read by cases._cuda; restored on return
    try:
        return _main(args, argv)
    finally:
        if before is None:
            os.environ.pop("GLM5_BENCH_BACKEND", None)
        else:
            os.environ["GLM5_BENCH_BACKEND"] = before


def bench_device(backend: str) -> str:
    """Where the timed tensors live: while ``backend``'s stack is simulated, its runtime device (``cpu``: a simulated
    stack that presents its devices as ``cuda`` answers ``torch.cuda.is_available()`` with no CUDA device behind it);
    else ``cuda`` when available, the CPU otherwise."""
    from glm5_core.backends import simulated

    if simulated.SIMULATED_BACKEND.get() is not None:
        from glm5_core import registry

        return torch.device(registry.get_backend(backend).device()).type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _main(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    device = bench_device(args.backend)
    t_start = time.perf_counter()
    peaks = device_peaks(device)
    header = {"device": device, "device_name": peaks.pop("name", device), "peaks": peaks,
              "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "torch": torch.__version__, "backend": args.backend}
    if args.simulated:
        header["simulated"] = args.simulated
    header["measured"] = measured_peaks(device)
    rows = []
    for build in cases.ALL_CASES:
        if (args.only and build.__name__ not in args.only) or build.__name__ in args.skip:
            continue
        if time.perf_counter() - t_start > args.budget_s:
            rows.append({"case": build.__name__, "error": "skipped: time budget spent"})
            continue
        try:
            rows.append(run_case(build, device, args.tiny, args.reps, peaks))
        except Exception as exc:
            rows.append({"case": build.__name__, "error": repr(exc)[:300]})
        if device == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    payload = {"header": header, "rows": rows}
    (args.out / f"{args.backend}_kernels_{stamp}.json").write_text(json.dumps(payload, indent=2))
    (args.out / f"{args.backend}_kernels_{stamp}.md").write_text(markdown(rows, header))
    print(markdown(rows, header))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
