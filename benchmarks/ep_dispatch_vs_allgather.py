"""Expert-parallel token exchange: glm5-core's all-to-all ``ep.dispatch`` + ``ep.combine`` against the all-gather
design (every rank gathers every rank's tokens, runs its own experts on the tokens routed to them, and the partial
outputs are summed back with a reduce-scatter: Megatron's ``MoEAllGatherTokenDispatcher``), on N gloo processes.

Both move the rows of one MoE layer and back; the experts are replaced by a row-wise scale (identical work in
both), so the figure is the exchange. Per run: bytes each rank sends per token per layer (counted from the splits
and tensor sizes, forward only, as a ratio of the all-gather's) and the median time of dispatch + combine over
interleaved rounds.

    python benchmarks/ep_dispatch_vs_allgather.py --world 2 4 --tokens 512 --hidden 1024 --experts 16 --top-k 4
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._results import write_json  # noqa: E402


def _inputs(rank, T, D, E, K, seed=0):
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), K, dim=-1)
    return x, ids.to(torch.int32), weights


def _all_to_all(x, ids, weights, E, group):
    from glm5_core.ops import ep

    handle = ep.dispatch(x, ids, weights, group=group, num_experts=E)
    out = ep.combine(handle.rows * 1.5, handle)
    sent = sum(handle.send_splits) - handle.send_splits[handle.rank]  # rows leaving this rank
    return out, sent * x.shape[1] * x.element_size() * 2  # there and back


def _all_gather(x, ids, weights, E, group):
    """Gather all tokens, apply the local experts to the rows routed to them, reduce-scatter the sums back."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    L = E // world
    xs = [torch.empty_like(x) for _ in range(world)]
    idss = [torch.empty_like(ids) for _ in range(world)]
    ws = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(xs, x, group=group)
    dist.all_gather(idss, ids, group=group)
    dist.all_gather(ws, weights, group=group)
    xa, ida, wa = torch.cat(xs), torch.cat(idss), torch.cat(ws)  # [N*T, D], [N*T, K], [N*T, K]
    local = (ida >= rank * L) & (ida < (rank + 1) * L)  # [N*T, K] slots this rank's experts serve
    partial = (xa * 1.5) * (wa * local).sum(-1, keepdim=True)  # the local experts' weighted contribution
    out = torch.empty_like(x)
    dist.reduce_scatter(out, list(partial.chunk(world)), group=group)
    T, D = x.shape
    sent = (world - 1) * T * (D * x.element_size() + ids.shape[1] * (ids.element_size() + weights.element_size())) \
        + (world - 1) * T * D * x.element_size()  # all-gathers out, reduce-scatter back
    return out, sent


def _worker(rank, world, init, args, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    group = dist.group.WORLD
    x, ids, weights = _inputs(rank, args.tokens, args.hidden, args.experts, args.top_k)
    times = {"all_to_all": [], "all_gather": []}
    sent = {}
    a2a, _ = _all_to_all(x, ids, weights, args.experts, group)
    gathered, _ = _all_gather(x, ids, weights, args.experts, group)
    torch.testing.assert_close(a2a, gathered, rtol=1e-5, atol=1e-5)  # both designs compute the same layer
    for r in range(args.rounds + 1):  # round 0 warms up
        order = ("all_to_all", "all_gather") if r % 2 == 0 else ("all_gather", "all_to_all")
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            _, sent[name] = (_all_to_all if name == "all_to_all" else _all_gather)(x, ids, weights, args.experts,
                                                                                 group)
            dist.barrier()
            if r:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        t = args.tokens
        result = {name: {"median_ms": 1e3 * statistics.median(v), "bytes_sent_per_token": sent[name] / t}
                  for name, v in times.items()}
        result["time_ratio_all_gather_over_all_to_all"] = \
            result["all_gather"]["median_ms"] / result["all_to_all"]["median_ms"]
        result["bytes_ratio_all_to_all_over_all_gather"] = \
            result["all_to_all"]["bytes_sent_per_token"] / result["all_gather"]["bytes_sent_per_token"]
        with open(result_file, "w") as f:
            import json
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/ep_dispatch_vs_allgather.json")
    args = parser.parse_args()
    import json

    results = {"command": "python " + " ".join(sys.argv), "load_average": os.getloadavg(),
               "sizes": {"tokens_per_rank": args.tokens, "hidden": args.hidden, "experts": args.experts,
                         "top_k": args.top_k, "dtype": "fp32", "rounds": args.rounds}, "runs": {}}
    for world in args.world:
        if args.experts % world:
            raise SystemExit(f"--experts: expected a multiple of every --world, got {args.experts} and {world}")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), args, out), nprocs=world,
                               start_method="spawn")
            results["runs"][f"world{world}"] = json.load(open(out))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
