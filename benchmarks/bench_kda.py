"""KDA chunked forward + backward: our ``kda.chunked`` on a backend (the cpu kernel by default) against
transformers' torch ``chunk_kimi_delta_attention`` (models/glm5_next, the fallback it runs without
flash-linear-attention), same inputs, same chunk size, q / k l2-normalised in the op as GLM-5.3 calls it.
Interleaved rounds (who goes first alternates), medians, the ratio from the one run, of both the wall time and
the process CPU time (``time.process_time``: every thread's CPU seconds; on a shared, loaded machine the wall time
also counts the waits for a core, the CPU time does not); the max difference of the outputs and gradients too.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_kda.py --out benchmarks/results/kda_chunked_cpu.json
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
from glm5_core.ops import kda


def _case(batch: int, tokens: int, heads: int, head_dim: int, device: str):
    shape = testing.KDAShape(batch, tokens, heads, head_dim, head_dim, C=64)
    x = testing.make_kda_inputs(shape, device=device, seed=0, initial_state=False)
    grad = testing.randn((batch, tokens, heads, head_dim), seed=9, device=device)
    return x, grad


def _run(fn, x, grad):
    """One forward + backward; returns (output, input gradients) for the agreement check."""
    leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
    out = fn(**leaves)
    out.backward(grad)
    return out.detach(), {k: leaves[k].grad for k in sorted(leaves)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128, help="GLM-5.3's linear_head_dim (keys and values)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", default="benchmarks/results/kda_chunked_cpu.json")
    args = parser.parse_args(argv)
    for name in ("batch", "tokens", "heads", "head_dim", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: expected an integer >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if registry.runs_reference("kda_chunked", args.backend):
        print(f"{args.backend} runs the reference for kda_chunked: nothing to compare", file=sys.stderr)
        return 1
    from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention

    device = registry.get_backend(args.backend).device()
    x, grad = _case(args.batch, args.tokens, args.heads, args.head_dim, device)

    def ours(q, k, v, g, beta):
        return kda.chunked(q, k, v, g, beta, chunk_size=64, use_qk_l2norm=True, backend=args.backend)[0]

    def theirs(q, k, v, g, beta):
        return chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=True)[0]

    impls = {"transformers": theirs, "glm5_core": ours}
    results = {label: _run(fn, x, grad) for label, fn in impls.items()}  # warm-up, and the agreement check
    out_diff = float((results["glm5_core"][0] - results["transformers"][0]).abs().max())
    grad_diff = max(float((results["glm5_core"][1][k] - results["transformers"][1][k]).abs().max())
                    for k in results["glm5_core"][1])
    times = {label: [] for label in impls}
    cpu_times = {label: [] for label in impls}
    for r in range(args.rounds):
        order = list(impls.items())
        for label, fn in order if r % 2 == 0 else order[::-1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            _run(fn, x, grad)
            times[label].append(time.perf_counter() - start)
            cpu_times[label].append(time.process_time() - cpu_start)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}
    speedup = med["transformers"] / med["glm5_core"]
    cpu_speedup = cpu_med["transformers"] / cpu_med["glm5_core"]
    case = f"B={args.batch} T={args.tokens} H={args.heads} K=V={args.head_dim} chunk 64, fp32"
    print(f"kda chunked fwd+bwd [{case}] on {args.backend}: wall transformers {med['transformers'] * 1e3:.1f} ms, "
          f"glm5_core {med['glm5_core'] * 1e3:.1f} ms ({speedup:.2f}x); CPU time {cpu_med['transformers']:.3f} s vs "
          f"{cpu_med['glm5_core']:.3f} s ({cpu_speedup:.2f}x); max |diff| output {out_diff:.2e}, "
          f"gradients {grad_diff:.2e}")
    write_json(args.out, {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                          "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                          "load_average": os.getloadavg(), "backend": args.backend, "case": case,
                          "rounds": args.rounds, "median_wall_s": med, "wall_s": times, "speedup_wall": speedup,
                          "median_cpu_s": cpu_med, "cpu_s": cpu_times, "speedup_cpu_time": cpu_speedup,
                          "max_abs_diff": {"output": out_diff, "gradients": grad_diff}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
