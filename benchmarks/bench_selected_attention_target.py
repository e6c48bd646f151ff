"""The sparse stage's indexer-KL target at the selected keys: reference vs the cpu kernel, both normalisers.

``dsa_selected_attention_target`` at the training benchmark's attention shape (8 heads, nope 32 + rope 16, expanded
keys given as the model gives them, keys from the native indexer top-k), fp32, for each ``--cases`` entry
BATCHxTOKENS (one top-k width each, ``--topk``). Timed, in an order that rotates every round; medians:
  ``reference`` / ``cpu``: ``normaliser="causal"`` (each head's softmax over every causal key), and the cpu
    kernel's two passes: ``cpu_lse_pass`` (the dense log-sum-exp), ``cpu_selected_pass`` (the selected keys);
  ``reference_selected`` / ``cpu_selected``: ``normaliser="selected"`` (each head's softmax over the selected keys,
    the sparse stage's default: one pass over the selected keys, no dense one).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_selected_attention_target.py --cases 2x512 1x4096 \\
        --topk 128 256 --rounds 7 --out benchmarks/results/selected_attention_target.json
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
from _args import batch_tokens  # benchmarks/, the script's folder
from _results import write_json

HEADS, NOPE, ROPE, LATENT, INDEX_HEADS, INDEX_DIM = 8, 32, 16, 128, 8, 64


def _inputs(batch: int, tokens: int, topk: int):
    from glm5_core.ops import dsa
    from glm5_core.ops.selected_attention_target import expanded_keys

    g = torch.Generator().manual_seed(0)
    x = {"q_nope": torch.randn(batch, tokens, HEADS, NOPE, generator=g),
         "q_pe": torch.randn(batch, tokens, HEADS, ROPE, generator=g),
         "c_kv": torch.randn(batch, tokens, LATENT, generator=g),
         "k_pe": torch.randn(batch, tokens, ROPE, generator=g),
         "w_uk": torch.randn(HEADS, NOPE, LATENT, generator=g) * LATENT ** -0.5}
    q_i = torch.randn(batch, tokens, INDEX_HEADS, INDEX_DIM, generator=g)
    k_i = torch.randn(batch, tokens, INDEX_DIM, generator=g)
    w_i = torch.randn(batch, tokens, INDEX_HEADS, generator=g)
    x["topk_idx"] = dsa.indexer_topk(q_i, k_i, w_i, topk, backend="cpu")  # [B, T, K]
    return x, expanded_keys(x["c_kv"], x["w_uk"])  # [B, S, H, Dn]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=batch_tokens(1), nargs="+", default=[(2, 512), (1, 4096)])
    parser.add_argument("--topk", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/selected_attention_target.json")
    args = parser.parse_args(argv)
    for name in ("rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if len(args.topk) != len(args.cases):
        parser.error(f"--topk: expected one width per case ({len(args.cases)}), got {len(args.topk)}")
    for (_, tokens), topk in zip(args.cases, args.topk):
        if not 1 <= topk <= tokens:
            parser.error(f"--topk: expected 1 <= topk <= tokens ({tokens}), got {topk}")
    from glm5_core import registry
    from glm5_core.backends.cpu import dsa_selected_attention_target as native
    from glm5_core.ops.selected_attention_target import selected_attention_target_reference

    torch.set_num_threads(args.threads)
    if registry.runs_reference("dsa_selected_attention_target", "cpu"):
        print("the cpu backend runs the reference for dsa_selected_attention_target (extension not built)",
              file=sys.stderr)
        return 1
    scale = (NOPE + ROPE) ** -0.5
    results = {}
    for (batch, tokens), topk in zip(args.cases, args.topk):
        x, k_nope = _inputs(batch, tokens, topk)
        kw = dict(scale=scale, start_pos=0, k_nope=k_nope)
        lse = native.dense_lse(x["q_nope"], x["q_pe"], k_nope, x["k_pe"], scale=scale, start_pos=0)
        start = torch.zeros(batch, dtype=torch.int64)
        causal = dict(kw, normaliser="causal")
        selected = dict(kw, normaliser="selected")
        impls = {"reference": functools.partial(selected_attention_target_reference, **x, **causal),
                 "cpu": functools.partial(native.selected_attention_target, **x, **causal),
                 "cpu_lse_pass": functools.partial(native.dense_lse, x["q_nope"], x["q_pe"], k_nope, x["k_pe"],
                                                   scale=scale, start_pos=0),
                 "cpu_selected_pass": functools.partial(torch.ops.glm5_cpu.selected_attention_target,
                                                        x["q_nope"], x["q_pe"], k_nope, x["k_pe"], lse,
                                                        x["topk_idx"], start, scale),
                 "reference_selected": functools.partial(selected_attention_target_reference, **x, **selected),
                 "cpu_selected": functools.partial(native.selected_attention_target, **x, **selected)}
        ref, got = impls["reference"](), impls["cpu"]()
        max_abs = float((got - ref).abs().max())
        max_abs_selected = float((impls["cpu_selected"]() - impls["reference_selected"]()).abs().max())
        names = list(impls)
        for name in names:
            impls[name]()  # warm-up
        times = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(_time(impls[name]))
        med = {n: statistics.median(v) for n, v in times.items()}
        key = f"{batch}x{tokens}-K{topk}"
        results[key] = {"median_s": med, "times_s": times, "speedup": med["reference"] / med["cpu"],
                        "max_abs_diff_vs_reference": max_abs,
                        "selected_speedup": med["reference_selected"] / med["cpu_selected"],
                        "selected_vs_causal_cpu": med["cpu"] / med["cpu_selected"],
                        "max_abs_diff_vs_reference_selected": max_abs_selected}
        print(f"{key}: causal: reference {1e3 * med['reference']:.1f} ms, cpu {1e3 * med['cpu']:.1f} ms "
              f"({results[key]['speedup']:.1f}x; lse pass {1e3 * med['cpu_lse_pass']:.1f} ms, selected pass "
              f"{1e3 * med['cpu_selected_pass']:.1f} ms); max |cpu - reference| {max_abs:.2e}; selected: reference "
              f"{1e3 * med['reference_selected']:.1f} ms, cpu {1e3 * med['cpu_selected']:.1f} ms "
              f"({results[key]['selected_speedup']:.1f}x; {results[key]['selected_vs_causal_cpu']:.1f}x the causal "
              f"cpu kernel); max |cpu - reference| {max_abs_selected:.2e}")
    write_json(args.out, {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                          "threads": args.threads, "rounds": args.rounds, "load_average": os.getloadavg(),
                          "cases": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
