"""MTP speculative decoding in the rollout engine: mean acceptance length and tokens/s against plain decoding.

    python benchmarks/bench_speculative.py [--checkpoint runs/tiny/final] [--rounds 9] [--new-tokens 128]
        [--speed-new-tokens 64] [--out benchmarks/results/bench_speculative.json]
    python benchmarks/bench_speculative.py --part costs [--out benchmarks/results/bench_speculative_costs.json]
    python benchmarks/bench_speculative.py --part speed [--temperature 0] [--batches 1] (the speed rounds only)

The checkpoint is the Quickstart's (``glm5 pretrain --config configs/tiny.yaml``), trained on the Python standard
library's sources; prompts are 96-byte windows of stdlib files (byte tokens), every request decodes
``--new-tokens`` tokens (no stop token). Acceptance: mean acceptance length (tokens a row gets per verify step:
accepted drafts + 1) at d = 1..4, greedy and at temperature 1, over 16 prompts at batch 8, and whether the greedy
tokens equal plain greedy decoding's. Speed: engine tokens/s
(generated tokens / wall time of ``generate``, prefill included; ``--speed-new-tokens`` per request) at batch 1
and 8 for plain decoding and d = 1..4, at ``--temperature`` (default 1.0, what RL rollouts sample at); the
configurations alternate within each round (interleaved rounds, order reversed every other round). Reported:
median tokens/s over rounds, and the median over rounds of each round's ratio to plain decoding in that round
(the figure to quote on a shared machine, where the load changes between rounds). The same figures are also
given in process CPU time (``*_cpu``: generated tokens per CPU-second of this process): on a loaded machine the
wall time also counts the time the process waited for a core, which changes between and within rounds; CPU time
counts only the time it ran (it still pays for caches shared with other processes), so its ratios are the stabler
ones there. On an idle machine the two agree. torch runs on one thread, as the Quickstart does.

``--part costs`` times the forwards a speculative step is made of, against a 100-token context, as the engine
calls them (batch 1: one int start position; batch 8: a tensor of them): the main model over T = 1, 3, 4, 5 new
positions (plain decoding, verify at d = 2, 3, 4) and one MTP forward with its logits over T = 1 (a chained
draft) and T = 4 (a draft-extend after 3 accepted drafts), at batch 1 and 8 (30 interleaved rounds, medians,
milliseconds of wall time and of process CPU time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from _results import write_json

from glm5_core.model.checkpoint import load_pretrained
from glm5_core.ops import _checks
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest
from glm5_core.rl.serving.speculative import mtp_forward, mtp_logits, new_mtp_cache
from glm5_core.train.data import stdlib_corpus

PROMPT_BYTES = 96


def prompts(n: int):
    corpus = stdlib_corpus()
    out, i = [], 0
    step = max(1, len(corpus) // (4 * n))
    while len(out) < n and i < len(corpus):
        doc = corpus[i]
        i += step
        if len(doc) >= 4 * PROMPT_BYTES:
            mid = len(doc) // 2
            out.append(list(doc[mid:mid + PROMPT_BYTES]))
    return out


def run(model, batch: int, ids, new_tokens: int, temperature: float, draft_tokens, seed: int):
    spec = {"draft_tokens": draft_tokens} if draft_tokens else None
    engine = RolloutEngine(model, max_batch=batch, max_len=PROMPT_BYTES + new_tokens + 1, prefix_cache_entries=0,
                           seed=seed, speculative=spec)
    requests = [GenerateRequest(f"b{i}", p, temperature=temperature, top_p=1.0, max_new_tokens=new_tokens)
                for i, p in enumerate(ids)]
    t0, c0 = time.perf_counter(), time.process_time()
    results = engine.generate(requests)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(r.output_ids) for r in results)
    acceptance = engine.speculative.stats.mean_acceptance_length() if engine.speculative else 1.0
    return (tokens / seconds, tokens / cpu_seconds), acceptance, [r.output_ids for r in results]


@torch.no_grad()
def forward_costs(model, rounds: int = 30):
    out = {}
    g = torch.Generator().manual_seed(0)
    for batch in (1, 8):
        cache, draft_cache = model.new_cache(batch, 256), new_mtp_cache(model, batch, 256)
        with _checks.skip_value_checks():
            model(torch.randint(0, 256, (batch, 100), generator=g), cache=cache, start_pos=0)
        pos = 100 if batch == 1 else torch.full((batch,), 100, dtype=torch.long)  # as the engine passes it

        def main_forward(T, batch=batch, cache=cache, pos=pos):
            with _checks.skip_value_checks():
                model(torch.randint(0, 256, (batch, T), generator=g), cache=cache, start_pos=pos)

        def mtp(T, batch=batch, draft_cache=draft_cache, pos=pos):
            h = mtp_forward(model, draft_cache, torch.randn(batch, T, model.config.hidden_size, generator=g),
                            torch.randint(0, 256, (batch, T), generator=g), pos)
            mtp_logits(model, h[:, -1])

        parts = {f"main T={T}": (lambda T=T: main_forward(T)) for T in (1, 3, 4, 5)}
        parts.update({f"mtp T={T}": (lambda T=T: mtp(T)) for T in (1, 4)})
        wall = {name: [] for name in parts}
        cpu = {name: [] for name in parts}
        for _ in range(rounds):
            for name, fn in parts.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        out[f"batch {batch}"] = {name: {"wall": round(1000 * statistics.median(wall[name]), 2),
                                        "cpu": round(1000 * statistics.median(cpu[name]), 2)} for name in parts}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="runs/tiny/final")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--speed-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes of the speed rounds")
    ap.add_argument("--part", choices=("all", "costs", "speed"), default="all")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/bench_speculative[_costs].json")
    args = ap.parse_args()
    if not os.path.isdir(args.checkpoint):
        print(f"--checkpoint: no such folder {args.checkpoint!r} (run: glm5 pretrain --config configs/tiny.yaml)",
              file=sys.stderr)
        sys.exit(2)
    if any(not 1 <= b <= 16 for b in args.batches):
        print(f"--batches: expected batch sizes in [1, 16] (16 prompts), got {args.batches}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    model = load_pretrained(args.checkpoint).eval()
    model.reuse_stacked_expert_weights(True)
    command = "python benchmarks/bench_speculative.py " + " ".join(sys.argv[1:])
    if args.part == "costs":
        write_json(args.out or "benchmarks/results/bench_speculative_costs.json",
                   {"command": command, "milliseconds": forward_costs(model), "load_average": os.getloadavg()})
        return
    ids = prompts(16)

    acceptance, greedy_equal = {}, {}
    _, _, plain_greedy = run(model, 8, ids, args.new_tokens, 0.0, None, seed=0) if args.part == "all" else (0, 0, 0)
    for temperature in (0.0, 1.0) if args.part == "all" else ():
        for d in (1, 2, 3, 4):
            _, a, outputs = run(model, 8, ids, args.new_tokens, temperature, d, seed=0)
            acceptance[f"T={temperature:g} d={d}"] = round(a, 3)
            if temperature == 0.0:
                greedy_equal[f"d={d}"] = outputs == plain_greedy
            print(f"acceptance T={temperature:g} d={d}: {a:.3f}", flush=True)

    configs = [None, 1, 2, 3, 4]
    batches = args.batches
    rates = {(b, d): [] for b in batches for d in configs}  # per round (wall, cpu) tokens per second
    accept_runs = {(b, d): [] for b in batches for d in configs}
    for r in range(args.rounds):
        for batch in batches:
            order = configs if r % 2 == 0 else configs[::-1]
            for d in order:
                rate, a, _ = run(model, batch, ids[:batch], args.speed_new_tokens, args.temperature, d, seed=r)
                rates[(batch, d)].append(rate)
                accept_runs[(batch, d)].append(a)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    speed = {}
    for batch in batches:
        for d in configs:
            key = f"batch {batch} " + (f"d={d}" if d else "plain")
            speed[key] = {"mean_acceptance_length": round(statistics.median(accept_runs[(batch, d)]), 3)}
            for clock, suffix in ((0, ""), (1, "_cpu")):
                mine = [x[clock] for x in rates[(batch, d)]]
                plain = [x[clock] for x in rates[(batch, None)]]
                med = statistics.median(mine)
                ratios = [x / p for x, p in zip(mine, plain)]
                speed[key].update({f"tokens_per_s{suffix}": round(med, 1),
                                   f"vs_plain{suffix}": round(med / statistics.median(plain), 2),
                                   f"vs_plain_median_of_round_ratios{suffix}": round(statistics.median(ratios), 2),
                                   f"rounds{suffix}": [round(x, 1) for x in mine]})
    result = {"command": command,
              "checkpoint": args.checkpoint, "new_tokens": args.new_tokens,
              "speed_new_tokens": args.speed_new_tokens, "prompt_bytes": PROMPT_BYTES,
              "temperature_for_speed": args.temperature, "rounds": args.rounds,
              "load_average": os.getloadavg(), "acceptance_length_batch8_16_prompts": acceptance,
              "greedy_tokens_equal_plain_greedy": greedy_equal, "speed": speed}
    write_json(args.out or "benchmarks/results/bench_speculative.json", result)


if __name__ == "__main__":
    main()
