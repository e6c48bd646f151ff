"""Discrete-event simulator of sync vs async RL at cluster scale, with a cost model calibrated here.

Cost model (per accelerator):
  decode step of b active sequences:  t_dec(b) = dec_fixed + dec_per_seq * b     (seconds / generated token)
  training:                            t_train(n tokens) = train_per_token * n / n_train  (data parallel)
  weight push:                         ``--push-seconds`` of trainer time per step (write + broadcast); the
                                       engines keep decoding meanwhile
  weights landing on an engine:        ``--push-pause-seconds``: when a push completes, every engine finishes
                                       the decode step in progress, then stops decoding this long (sync: once
                                       per iteration, before the next rollout)
The default pause is 0, as in glm5_core's RolloutEngine: the server thread reads the new file while decode
goes on and the engine swaps the tensors in between two decode steps (an in-memory copy, small next to a
decode step at this scale). Set it to model a weight update that stops generation (e.g. a collective
broadcast into the engines). Without ``--cost`` the script calibrates dec_fixed / dec_per_seq / train_per_token
on the tiny model on this machine (RolloutEngine decode steps at batch 1 and ``--engine-batch``;
Trainer-equivalent forward+backward per token); ``--cost FILE`` reads them instead (a cost JSON, or an
earlier result of this script, whose ``cost_model`` is used). The cluster has ``--rollout`` engine
accelerators and ``--train`` training accelerators.

Workload: trajectories with a long-tailed number of generated tokens (lognormal, capped). sync: each
iteration generates a batch spread over all engines (continuous batching inside an engine), waits for the
last trajectory, trains, pushes. async: engines keep their slots full, admitting a new trajectory only while
it would be at most ``--staleness`` versions old (AReaL-style bound); the trainer takes a batch (the first
``--batch`` trajectories to finish) whenever one is ready. Each sequence is tracked by identity: a finished
sequence is credited with its own length. Reported: rollout utilisation (mean slot occupancy while
decoding), trainer utilisation (compute fraction), trained tokens per second.

    python benchmarks/rl_sim.py [--rollout 64 --train 64 --batch 1024 --iterations 20] [--cost FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Optional

COST_KEYS = ("dec_fixed", "dec_per_seq", "train_per_token")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Sizes and costs of one simulated run (see the module docstring)."""

    rollout: int  # engines (one accelerator each)
    train: int  # training accelerators (data parallel)
    slots: int  # concurrent sequences per engine
    batch: int  # trajectories per trainer step
    iterations: int  # trainer steps
    staleness: int = 2  # async: a trajectory is admitted only while it is at most this many versions old
    push_seconds: float = 0.0  # trainer time per weight push
    push_pause_seconds: float = 0.0  # engine time lost when new weights land


def calibrate(engine_batch: int) -> dict[str, float]:
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


def lengths(rng: random.Random, n: int, median: float, sigma: float, cap: int) -> list[int]:
    return [max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


@dataclasses.dataclass
class Trajectory:
    length: int  # generated tokens in total
    remaining: int  # tokens still to generate


class Engine:
    """Continuous batching: up to ``slots`` sequences decode together, one token each per step."""

    def __init__(self, slots: int, cost: dict[str, float]):
        self.slots, self.cost = slots, cost
        self.active: list[Trajectory] = []
        self.occupied_time = 0.0  # integral of (active / slots) dt while decoding

    def add(self, length: int) -> None:
        self.active.append(Trajectory(length, length))

    def step_time(self) -> float:
        return self.cost["dec_fixed"] + self.cost["dec_per_seq"] * len(self.active)

    def tokens_to_next_finish(self) -> int:
        return min(t.remaining for t in self.active)

    def decode(self, steps: int) -> tuple[float, list[int]]:
        """Run ``steps`` decode steps (at most :meth:`tokens_to_next_finish`): (duration, lengths of the
        trajectories that finished, in slot order)."""
        duration = steps * self.step_time()
        self.occupied_time += duration * len(self.active) / self.slots
        for t in self.active:
            t.remaining -= steps
        finished = [t.length for t in self.active if t.remaining == 0]
        self.active = [t for t in self.active if t.remaining > 0]
        return duration, finished

    def advance(self) -> tuple[float, list[int]]:
        """Decode until the shortest active sequence finishes."""
        return self.decode(self.tokens_to_next_finish())


def simulate_sync(c: Cluster, cost: dict[str, float], batches: Sequence[Sequence[int]]) -> dict:
    """``batches``: the generated-token counts of each iteration's trajectories (``c.iterations`` lists)."""
    engines = [Engine(c.slots, cost) for _ in range(c.rollout)]
    clock = train_busy = trained = 0.0
    steps = []
    for iteration, batch in enumerate(batches[:c.iterations]):
        if iteration:
            clock += c.push_pause_seconds  # the previous push's weights land before this rollout
        ends = []
        for e_index, e in enumerate(engines):
            queue = list(batch[e_index::c.rollout])
            t = 0.0
            while queue or e.active:
                while queue and len(e.active) < e.slots:
                    e.add(queue.pop())
                t += e.advance()[0]
            ends.append(t)
        start = clock + max(ends)
        train_time = cost["train_per_token"] * sum(batch) / c.train
        clock = start + train_time + c.push_seconds
        steps.append({"start_s": start, "end_s": clock, "tokens": sum(batch)})
        train_busy += train_time
        trained += sum(batch)
    return _report(engines, c, clock, trained, train_busy, steps)


def _report(engines: list[Engine], c: Cluster, clock: float, trained: float, train_busy: float,
            steps: list[dict]) -> dict:
    return {"wall_s": clock, "trained_tokens": trained, "trained_tokens_per_s": trained / clock,
            "rollout_utilisation": sum(e.occupied_time for e in engines) / (c.rollout * clock),
            "trainer_utilisation": train_busy / clock,
            "trainer_push_fraction": len(steps) * c.push_seconds / clock, "trainer_steps": steps}


class AsyncSimulation:
    """Event loop of the async mode. Each engine is decoding (one event scheduled at the end of its current
    run of decode steps), paused (new weights landing; one resume event) or idle (nothing to admit under the
    staleness bound: it waits for the next trainer step). Events carry the engine's epoch; rescheduling an
    engine bumps it, so its older event is skipped."""

    def __init__(self, c: Cluster, cost: dict[str, float], pool: Sequence[int]):
        self.c, self.cost, self.pool = c, cost, list(pool)
        self.engines = [Engine(c.slots, cost) for _ in range(c.rollout)]
        self.state = ["idle"] * c.rollout
        self.epoch = [0] * c.rollout
        self.segment_start = [0.0] * c.rollout  # when the current run of decode steps began
        self.segment_steps = [0] * c.rollout  # decode steps the scheduled event completes
        self.pause_after = [0.0] * c.rollout  # decoding engine: pause owed once the step in progress ends
        self.resume_at = [0.0] * c.rollout
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, engine, epoch)
        self._order = itertools.count()  # ties: first scheduled, first handled
        self.started = self.version = self.steps_done = 0
        self.ready: list[int] = []  # lengths of finished, untrained trajectories, in finishing order
        self.training = False
        self.train_busy = self.trained = 0.0
        self.steps: list[dict] = []

    def _schedule(self, at: float, kind: str, i: int = -1) -> None:
        heapq.heappush(self.events, (at, next(self._order), kind, i, self.epoch[i] if i >= 0 else 0))

    def _admit_and_decode(self, i: int, now: float) -> None:
        e = self.engines[i]
        bound = (self.version + self.c.staleness + 1) * self.c.batch
        while len(e.active) < e.slots and self.started < min(bound, len(self.pool)):
            e.add(self.pool[self.started])
            self.started += 1
        self.epoch[i] += 1
        if not e.active:
            self.state[i] = "idle"
            return
        self.state[i] = "decoding"
        self.segment_start[i], self.segment_steps[i] = now, e.tokens_to_next_finish()
        self._schedule(now + self.segment_steps[i] * e.step_time(), "decoded", i)

    def _weights_land(self, i: int, now: float) -> None:
        pause = self.c.push_pause_seconds
        if self.state[i] == "idle":
            if pause > 0:
                self._pause(i, now + pause)
            else:
                self._admit_and_decode(i, now)
        elif pause <= 0:
            return
        elif self.state[i] == "paused":
            self._pause(i, self.resume_at[i] + pause)
        else:  # decoding: the step in progress completes, then the pause
            e = self.engines[i]
            step = e.step_time()
            done = math.ceil((now - self.segment_start[i]) / step - 1e-9)  # steps completed or under way
            self.segment_steps[i] = min(self.segment_steps[i], max(0, done))
            self.pause_after[i] += pause
            self.epoch[i] += 1
            self._schedule(self.segment_start[i] + self.segment_steps[i] * step, "decoded", i)

    def _pause(self, i: int, until: float) -> None:
        self.state[i], self.resume_at[i] = "paused", until
        self.epoch[i] += 1
        self._schedule(until, "resume", i)

    def _maybe_train(self, now: float) -> None:
        if self.training or len(self.ready) < self.c.batch:
            return
        batch, self.ready = self.ready[:self.c.batch], self.ready[self.c.batch:]
        train_time = self.cost["train_per_token"] * sum(batch) / self.c.train
        end = now + train_time + self.c.push_seconds
        self.training = True
        self.train_busy += train_time
        self.trained += sum(batch)
        self.steps.append({"start_s": now, "end_s": end, "tokens": sum(batch)})
        self._schedule(end, "train-done")

    def run(self) -> dict:
        for i in range(self.c.rollout):
            self._admit_and_decode(i, 0.0)
        clock = 0.0
        while self.steps_done < self.c.iterations:
            if not self.events:
                raise ValueError(f"pool: {len(self.pool)} trajectories ran out before step {self.steps_done + 1} "
                                 f"of {self.c.iterations} (batch {self.c.batch})")
            now, _, kind, i, epoch = heapq.heappop(self.events)
            if i >= 0 and epoch != self.epoch[i]:
                continue  # rescheduled since
            clock = now
            if kind == "decoded":
                _, finished = self.engines[i].decode(self.segment_steps[i])
                self.ready.extend(finished)
                if self.pause_after[i] > 0:
                    self._pause(i, now + self.pause_after[i])
                    self.pause_after[i] = 0.0
                else:
                    self._admit_and_decode(i, now)
            elif kind == "resume":
                self._admit_and_decode(i, now)
            else:  # train-done: the pushed weights land on every engine, and the staleness bound moves
                self.training = False
                self.version += 1
                self.steps_done += 1
                for j in range(self.c.rollout):
                    self._weights_land(j, now)
            self._maybe_train(now)
        return _report(self.engines, self.c, clock, self.trained, self.train_busy, self.steps)


def simulate_async(c: Cluster, cost: dict[str, float], pool: Sequence[int]) -> dict:
    """``pool``: generated-token counts of the trajectories, in the order engines admit them."""
    return AsyncSimulation(c, cost, pool).run()


def load_cost(path: str) -> dict[str, float]:
    """A cost JSON (``dec_fixed``, ``dec_per_seq``, ``train_per_token``) or an earlier result of this script."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"--cost: cannot read {path!r}: {exc}") from None
    cost = data.get("cost_model", data) if isinstance(data, dict) else None
    if not isinstance(cost, dict):
        raise ValueError(f"--cost: expected a JSON object with {list(COST_KEYS)} (or a 'cost_model' one) in {path!r}")
    for key in COST_KEYS:
        value = cost.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"--cost: {key!r} in {path!r}: expected a finite number >= 0, got {value!r}")
    return cost


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout", type=_positive_int, default=64, help="rollout accelerators (one engine each)")
    parser.add_argument("--train", type=_positive_int, default=64, help="training accelerators (data parallel)")
    parser.add_argument("--slots", type=_positive_int, default=32, help="concurrent sequences per engine")
    parser.add_argument("--batch", type=_positive_int, default=2048, help="trajectories per trainer step")
    parser.add_argument("--iterations", type=_positive_int, default=10)
    parser.add_argument("--median", type=_positive, default=2000, help="median generated tokens per trajectory")
    parser.add_argument("--sigma", type=_non_negative, default=1.2, help="lognormal sigma (tail weight)")
    parser.add_argument("--cap", type=_positive_int, default=64000)
    parser.add_argument("--staleness", type=_non_negative_int, default=2)
    parser.add_argument("--push-seconds", type=_non_negative, default=0.0, help="trainer time per weight push")
    parser.add_argument("--push-pause-seconds", type=_non_negative, default=0.0,
                        help="engines stop decoding this long when new weights land (default 0: swapped between steps)")
    parser.add_argument("--engine-batch", type=_positive_int, default=32,
                        help="batch used to calibrate the decode cost")
    parser.add_argument("--cost", default=None, help="cost JSON (or an earlier result file) instead of calibrating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/rl_sim.json")
    args = parser.parse_args(argv)
    if args.cost:
        try:
            cost = load_cost(args.cost)
        except ValueError as exc:
            parser.exit(2, f"{exc}\n")
    else:
        cost = calibrate(args.engine_batch)
    c = Cluster(rollout=args.rollout, train=args.train, slots=args.slots, batch=args.batch,
                iterations=args.iterations, staleness=args.staleness, push_seconds=args.push_seconds,
                push_pause_seconds=args.push_pause_seconds)
    rng = random.Random(args.seed)
    batches = [lengths(rng, c.batch, args.median, args.sigma, args.cap) for _ in range(c.iterations)]
    rng = random.Random(args.seed)
    pool = lengths(rng, c.iterations * c.batch + c.rollout * c.slots * (c.staleness + 2), args.median, args.sigma,
                   args.cap)
    results = {"sync": simulate_sync(c, cost, batches), "async": simulate_async(c, cost, pool)}
    results["async_over_sync_throughput"] = (results["async"]["trained_tokens_per_s"]
                                             / results["sync"]["trained_tokens_per_s"])
    command = "python " + " ".join(sys.argv if argv is None else ["benchmarks/rl_sim.py", *argv])
    out = {"command": command, "cost_model": cost,
           "workload": {**dataclasses.asdict(c), "median": args.median, "sigma": args.sigma, "cap": args.cap,
                        "seed": args.seed}, "results": results}
    from _results import write_json  # benchmarks/ (the script's folder) is on sys.path when run as a script

    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
