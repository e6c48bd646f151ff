"""Discrete-event simulator of sync vs async RL at cluster scale, with a cost model calibrated here.

Cost model (per accelerator):
  decode step of b active sequences:  t_dec(b) = dec_fixed + dec_per_seq * b     (seconds / generated token)
  training:                            t_train(n tokens) = train_per_token * n / n_train  (data parallel)
  weight push:                         push_seconds, engines paused meanwhile
``--calibrate`` (default) measures dec_fixed / dec_per_seq / train_per_token on the tiny model on this machine
(RolloutEngine decode steps at batch 1 and ``--engine-batch``; Trainer-equivalent forward+backward per
token); the cluster then has ``--rollout`` engine accelerators and ``--train`` training accelerators.

Workload: trajectories with a long-tailed number of generated tokens (lognormal, capped). sync: each
iteration generates a batch spread over all engines (continuous batching inside an engine), waits for the
last trajectory, trains, pushes. async: engines keep their slots full, admitting a new trajectory only while
it would be at most ``--staleness`` versions old (AReaL-style bound); the trainer takes a batch whenever one
is ready. Reported: rollout utilisation (mean slot occupancy), trainer utilisation (busy fraction),
trained tokens per second.

    python benchmarks/rl_sim.py [--rollout 64 --train 64 --batch 1024 --iterations 20]
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from typing import Dict, List

from _results import write_json


def calibrate(engine_batch: int) -> Dict[str, float]:
    import torch

    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(GLM5Config.tiny()).eval()

    def decode_time(b: int) -> float:
        cache = model.new_cache(b, 256)
        ids = torch.randint(0, 256, (b, 1))
        times = []
        with torch.no_grad():
            for step in range(40):
                t0 = time.perf_counter()
                model(ids, attention="sparse", cache=cache, start_pos=torch.full((b,), 64 + step))
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    t1, tb = decode_time(1), decode_time(engine_batch)
    per_seq = max(tb - t1, 0.0) / (engine_batch - 1)
    ids = torch.randint(0, 256, (8, 128))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        model(ids, attention="sparse").logits.float().logsumexp(-1).mean().backward()
        times.append(time.perf_counter() - t0)
    train_per_token = sorted(times)[2] / ids.numel()
    return {"dec_fixed": t1 - per_seq, "dec_per_seq": per_seq, "train_per_token": train_per_token,
            "measured": {"decode_b1_s": t1, f"decode_b{engine_batch}_s": tb, "train_fwd_bwd_8x128_s": sorted(times)[2]}}


def lengths(rng: random.Random, n: int, median: float, sigma: float, cap: int) -> List[int]:
    return [max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


class Engine:
    """Continuous batching: ``slots`` sequences at a time; ``advance`` runs decode until a sequence ends."""

    def __init__(self, slots: int, cost: Dict[str, float]):
        self.slots, self.cost = slots, cost
        self.active: List[int] = []  # remaining tokens
        self.occupied_time = 0.0  # integral of (active / slots) dt

    def step_time(self) -> float:
        return self.cost["dec_fixed"] + self.cost["dec_per_seq"] * len(self.active)

    def advance(self) -> (float, int):
        """Decode until the shortest active sequence finishes: (duration, tokens generated)."""
        d = min(self.active)
        duration = d * self.step_time()
        self.occupied_time += duration * len(self.active) / self.slots
        tokens = d * len(self.active)
        self.active = [r - d for r in self.active]
        finished = sum(1 for r in self.active if r == 0)
        self.active = [r for r in self.active if r > 0]
        return duration, tokens, finished


def simulate_sync(args, cost, rng) -> Dict[str, float]:
    engines = [Engine(args.slots, cost) for _ in range(args.rollout)]
    clock = train_busy = trained = 0.0
    for _ in range(args.iterations):
        batch = lengths(rng, args.batch, args.median, args.sigma, args.cap)
        ends = []
        for e_index, e in enumerate(engines):
            queue = batch[e_index::args.rollout]
            t = 0.0
            while queue or e.active:
                while queue and len(e.active) < e.slots:
                    e.active.append(queue.pop())
                duration, _, _ = e.advance()
                t += duration
            ends.append(t)
        rollout_time = max(ends)
        train_time = cost["train_per_token"] * sum(batch) / args.train
        clock += rollout_time + train_time + args.push_seconds
        train_busy += train_time
        trained += sum(batch)
    return {"wall_s": clock, "trained_tokens_per_s": trained / clock,
            "rollout_utilisation": sum(e.occupied_time for e in engines) / (args.rollout * clock),
            "trainer_utilisation": train_busy / clock}


def simulate_async(args, cost, rng) -> Dict[str, float]:
    engines = [Engine(args.slots, cost) for _ in range(args.rollout)]
    total = args.iterations * args.batch
    pool = lengths(rng, total + args.rollout * args.slots * (args.staleness + 2), args.median, args.sigma, args.cap)
    started = 0
    version = 0
    ready_tokens: List[int] = []
    events = []  # (time, kind, engine index)
    pending_len: Dict[int, List[int]] = {i: [] for i in range(args.rollout)}
    trainer_free_at = 0.0
    train_busy = trained = 0.0
    clock = 0.0

    def admit(i: int, now: float):
        nonlocal started
        e = engines[i]
        while len(e.active) < e.slots and started < (version + args.staleness + 1) * args.batch:
            n = pool[started]
            started += 1
            e.active.append(n)
            pending_len[i].append(n)
        if e.active:
            d = min(e.active)
            heapq.heappush(events, (now + d * e.step_time(), "engine", i))
        else:
            heapq.heappush(events, (now + 0.05, "engine-idle", i))

    for i in range(args.rollout):
        admit(i, 0.0)
    steps = 0
    while steps < args.iterations:
        now, kind, i = heapq.heappop(events)
        clock = now
        if kind == "engine":
            e = engines[i]
            before = list(e.active)
            _, _, _ = e.advance()
            done = len(before) - len(e.active)
            # the finished ones are the shortest of the batch
            for n in sorted(pending_len[i])[:done]:
                pending_len[i].remove(n)
                ready_tokens.append(n)
            admit(i, now)
        elif kind == "engine-idle":
            admit(i, now)
        elif kind == "train-done":
            version += 1
            steps += 1
        if now >= trainer_free_at and len(ready_tokens) >= args.batch:
            batch, ready_tokens[:] = ready_tokens[:args.batch], ready_tokens[args.batch:]
            train_time = cost["train_per_token"] * sum(batch) / args.train + args.push_seconds
            trainer_free_at = now + train_time
            train_busy += train_time - args.push_seconds
            trained += sum(batch)
            heapq.heappush(events, (trainer_free_at, "train-done", -1))
    return {"wall_s": clock, "trained_tokens_per_s": trained / clock,
            "rollout_utilisation": sum(e.occupied_time for e in engines) / (args.rollout * clock),
            "trainer_utilisation": train_busy / clock}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout", type=int, default=64, help="rollout accelerators (one engine each)")
    parser.add_argument("--train", type=int, default=64, help="training accelerators (data parallel)")
    parser.add_argument("--slots", type=int, default=32, help="concurrent sequences per engine")
    parser.add_argument("--batch", type=int, default=2048, help="trajectories per trainer step")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--median", type=float, default=2000, help="median generated tokens per trajectory")
    parser.add_argument("--sigma", type=float, default=1.2, help="lognormal sigma (tail weight)")
    parser.add_argument("--cap", type=int, default=64000)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--push-seconds", type=float, default=0.0)
    parser.add_argument("--engine-batch", type=int, default=32, help="batch used to calibrate the decode cost")
    parser.add_argument("--cost", default=None, help="JSON cost model instead of calibrating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/rl_sim.json")
    args = parser.parse_args()
    cost = json.load(open(args.cost)) if args.cost else calibrate(args.engine_batch)
    results = {"sync": simulate_sync(args, cost, random.Random(args.seed)),
               "async": simulate_async(args, cost, random.Random(args.seed))}
    results["async_over_sync_throughput"] = (results["async"]["trained_tokens_per_s"]
                                             / results["sync"]["trained_tokens_per_s"])
    out = {"command": "python " + " ".join(sys.argv), "cost_model": cost, "workload": {
        k: getattr(args, k) for k in ("rollout", "train", "slots", "batch", "iterations", "median", "sigma", "cap",
                                      "staleness", "push_seconds")}, "results": results}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
