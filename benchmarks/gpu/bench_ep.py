"""Expert-parallel token exchange on several GPUs: DeepEP (``ElasticBuffer``, backends/cuda/ep.py) against the
reference (``all_to_all_single`` with uneven splits over NCCL, glm5_core/ops/ep.py), one MoE layer's dispatch
and combine, under torchrun (one process per GPU).

    torchrun --standalone --nproc-per-node 8 benchmarks/gpu/bench_ep.py --out "$OUT/ep_gpu_8gpu.json"
    benchmarks/gpu/run_ep.sh                                    # the same, over every visible GPU
    torchrun --standalone --nproc-per-node 2 benchmarks/gpu/bench_ep.py --dry-run --out /tmp/ep.json
        # gloo on CPU, tiny sizes, every code path (DeepEP through --deep-ep-module, e.g. the stand-in of the tests)

Implementations (bf16, the experts replaced by the identity so the figure is the exchange):
  * ``reference``: ``ep.dispatch_reference`` + ``ep.combine_reference`` (what training runs without DeepEP);
  * ``deep_ep_dispatch+reference_combine``: DeepEP's dispatch, the reference combine (what training runs with
    DeepEP: the contract's fp32 slot-order combine);
  * ``deep_ep``: DeepEP's dispatch + DeepEP's combine under torch.inference_mode (rollout).
Where ``deep_ep`` is not importable (or the device is not cuda) the DeepEP rows say why instead of a time.

Per implementation: the median over rounds of the slowest rank's dispatch and combine milliseconds (barrier, then
a device synchronise around each), and the bytes each rank sends to OTHER ranks per token per layer, counted from
the routing: the reference sends one row per (token, slot) whose expert lives elsewhere, there and back (+ the
[N, L] int64 counts); DeepEP's dispatch sends a token once per other rank holding one of its experts, with its
top-k ids (int64) and weights (fp32) (``deep_ep/utils/refs.py``), and its expand-mode combine one row per
(token, slot) back. Each DeepEP run also checks the contract: its rows bitwise the reference's, the training
combine bitwise, the rollout combine's largest difference recorded.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEFAULT_OUT = "ep_gpu.json"
IMPLS = ("reference", "deep_ep_dispatch+reference_combine", "deep_ep")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the usage too)
        print(f"bench_ep.py: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=_positive, default=4096, help="tokens per rank (default 4096)")
    parser.add_argument("--hidden", type=_positive, default=7168, help="hidden size D (default 7168, GLM-5)")
    parser.add_argument("--experts", type=_positive, default=256, help="routed experts E (default 256)")
    parser.add_argument("--top-k", type=_positive, default=8, help="experts per token K (default 8)")
    parser.add_argument("--rounds", type=_positive, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="collective backend: nccl on GPUs, gloo on CPU")
    parser.add_argument("--deep-ep-module", default="deep_ep",
                        help="the module providing ElasticBuffer (default deep_ep)")
    parser.add_argument("--dry-run", action="store_true",
                        help="gloo on CPU with tiny sizes (tokens 24, hidden 32, experts 8, top-k 2, 2 rounds)")
    parser.add_argument("--out", default=None,
                        help=f"results JSON (default $OUT/{DEFAULT_OUT}, else benchmarks/results/{DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.backend, args.tokens, args.hidden, args.experts, args.top_k = "gloo", 24, 32, 8, 2
        args.rounds, args.warmup = 2, 1
    if args.top_k > args.experts:
        parser.error(f"--top-k: expected at most --experts ({args.experts}), got {args.top_k}")
    if args.warmup < 0:
        parser.error(f"--warmup: expected a non-negative integer, got {args.warmup}")
    if args.out is None:
        root = os.environ.get("OUT") or str(Path(__file__).resolve().parents[1] / "results")
        args.out = os.path.join(root, DEFAULT_OUT)
    return args


def _inputs(rank: int, T: int, D: int, E: int, K: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    weights, ids = torch.topk(torch.randn(T, E, generator=g).softmax(-1), K, dim=-1)
    return x.to(device), ids.to(torch.int32).to(device), weights.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes_reference(ids, E: int, world: int, rank: int, D: int) -> int:
    L = E // world
    owner = ids.long() // L  # [T, K]
    remote_slots = int((owner != rank).sum())
    return 2 * remote_slots * D * 2 + 2 * world * L * 8  # bf16 rows there and back, the counts exchange


def _bytes_deep_ep(ids, E: int, world: int, rank: int, D: int) -> int:
    L = E // world
    K = ids.shape[1]
    owner = ids.long() // L  # [T, K]
    per_rank = torch.zeros(ids.shape[0], world, dtype=torch.bool, device=ids.device)
    per_rank.scatter_(1, owner, True)
    per_rank[:, rank] = False
    tokens_out = int(per_rank.sum())  # a token once per other rank holding one of its experts
    remote_slots = int((owner != rank).sum())
    return tokens_out * (D * 2 + K * 8 + K * 4) + remote_slots * D * 2


def _timed(fn, device, group):
    dist.barrier(group)
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def _slowest(seconds: float, device, group) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _deep_ep_buffer(args, group, why_not: list):
    """The ElasticBuffer of ``--deep-ep-module`` (built as backends/cuda/ep.make_buffer builds it), or None with
    the reason appended to ``why_not``. Decided alike on every rank (importability and the device)."""
    from glm5_core.backends.cuda import ep as cuda_ep

    if args.deep_ep_module == "deep_ep":
        ok, why = cuda_ep.L.deep_ep_importable()
        if not ok:
            why_not.append(why)
            return None
        if args.backend != "nccl":
            why_not.append("DeepEP runs on cuda tensors over NCCL: --backend nccl")
            return None
        return cuda_ep.make_buffer(group, num_max_tokens_per_rank=args.tokens, hidden=args.hidden,
                                   num_topk=args.top_k)
    module = importlib.import_module(args.deep_ep_module)
    return module.ElasticBuffer(group, num_max_tokens_per_rank=args.tokens, hidden=args.hidden, num_topk=args.top_k,
                                deterministic=True, allow_multiple_reduction=False)


def run(args: argparse.Namespace) -> dict:
    from glm5_core.backends.cuda import ep as cuda_ep
    from glm5_core.ops import ep

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if args.experts % world:
        raise ValueError(f"--experts: expected a multiple of the world size {world}, got {args.experts}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else \
        torch.device("cpu")
    x, ids, w = _inputs(rank, args.tokens, args.hidden, args.experts, args.top_k, device)
    E = args.experts
    why_not: list[str] = []
    buffer = _deep_ep_buffer(args, group, why_not)

    def reference_dispatch():
        return ep.dispatch_reference(x, ids, w, group=group, num_experts=E)

    def deep_dispatch():
        return cuda_ep.dispatch(x, ids, w, group=group, num_experts=E, buffer=buffer)

    def rollout_combine(h):
        with torch.inference_mode():
            return cuda_ep.combine(h.rows, h.weights, h)

    plans = {"reference": (reference_dispatch, lambda h: ep.combine_reference(h.rows, h.weights, h))}
    if buffer is not None:
        plans["deep_ep_dispatch+reference_combine"] = (deep_dispatch,
                                                       lambda h: ep.combine_reference(h.rows, h.weights, h))
        plans["deep_ep"] = (deep_dispatch, rollout_combine)
    results: dict = {}
    checks: dict = {}
    for name in IMPLS:
        if name not in plans:
            results[name] = {"skipped": why_not[0] if why_not else "not run"}
            continue
        dispatch_fn, combine_fn = plans[name]
        times = {"dispatch": [], "combine": []}
        for r in range(args.warmup + args.rounds):
            handle, t_dispatch = _timed(dispatch_fn, device, group)
            out, t_combine = _timed(lambda fn=combine_fn, h=handle: fn(h), device, group)
            if r >= args.warmup:
                times["dispatch"].append(_slowest(t_dispatch, device, group))
                times["combine"].append(_slowest(t_combine, device, group))
        checks[name] = (handle.rows, out)
        count = _bytes_reference if name == "reference" else _bytes_deep_ep
        sent = torch.tensor([count(ids, E, world, rank, args.hidden) / args.tokens], dtype=torch.float64,
                            device=device)
        dist.all_reduce(sent, group=group)
        totals = [a + b for a, b in zip(times["dispatch"], times["combine"])]
        results[name] = {"dispatch_ms_median": 1e3 * statistics.median(times["dispatch"]),
                         "combine_ms_median": 1e3 * statistics.median(times["combine"]),
                         "total_ms_median": 1e3 * statistics.median(totals),
                         "bytes_sent_per_token_per_layer": float(sent) / world}
    if buffer is not None:  # the contract, on every rank, agreed by one all-reduce
        rows_ref, out_ref = checks["reference"]
        rows_deep, out_train = checks["deep_ep_dispatch+reference_combine"]
        _, out_roll = checks["deep_ep"]
        verdict = torch.tensor([float(not torch.equal(rows_deep, rows_ref)), float(not torch.equal(out_train, out_ref)),
                                float((out_roll.float() - out_ref.float()).abs().max()) if out_ref.numel() else 0.0],
                               dtype=torch.float64, device=device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
        results["contract"] = {"rows_bitwise_equal": not bool(verdict[0]),
                               "training_combine_bitwise_equal": not bool(verdict[1]),
                               "rollout_combine_max_abs_diff": float(verdict[2])}
        ref = results["reference"]["total_ms_median"]
        results["ratios"] = {name: {"total_ms_over_reference": results[name]["total_ms_median"] / ref,
                                    "bytes_over_reference": results[name]["bytes_sent_per_token_per_layer"]
                                    / results["reference"]["bytes_sent_per_token_per_layer"]}
                             for name in IMPLS[1:]}
    return results


def environment(args) -> dict:
    env = {"torch": torch.__version__, "world_size": dist.get_world_size(), "collective": args.backend}
    if args.backend == "nccl" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    name = args.deep_ep_module
    env["deep_ep_module"] = name
    module = sys.modules.get(name)  # imported by the run if it was used (never imported here for the record)
    env["deep_ep_version"] = getattr(module, "__version__", None) if module is not None else None
    return env


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("bench_ep.py: error: run it under torchrun (one process per GPU), e.g. benchmarks/gpu/run_ep.sh",
              file=sys.stderr)
        return 2
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            print("bench_ep.py: error: --backend nccl needs cuda GPUs (none here): --dry-run runs gloo on CPU",
                  file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=300))
    try:
        try:
            results = run(args)
        except ValueError as exc:
            if dist.get_rank() == 0:
                print(f"bench_ep.py: error: {exc}", file=sys.stderr)
            return 2
        if dist.get_rank() == 0:
            record = {"command": "torchrun ... " + " ".join(["benchmarks/gpu/bench_ep.py"] + sys.argv[1:]),
                      "environment": environment(args),
                      "sizes": {"tokens_per_rank": args.tokens, "hidden": args.hidden, "experts": args.experts,
                                "top_k": args.top_k, "dtype": "bf16", "rounds": args.rounds, "warmup": args.warmup},
                      "results": results}
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=2)
            print(json.dumps(record, indent=2))
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
