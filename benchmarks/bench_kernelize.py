"""transformers' GlmMoeDsaForCausalLM before and after ``glm5_core.integrations.transformers.kernelize``, cpu.

Two models with the same random weights (one deep copy kernelized), timed in interleaved rounds (before,
after, before, after, ...) so machine load hits both alike; medians over the rounds:
  * prefill: one forward over B=1 x 4096 tokens (no cache; logits of the last position, as generate's
    prefill computes them), tokens/s;
  * generate: batch 8, a 512-token prompt, 32 greedy new tokens (transformers' DynamicCache), new tokens/s.
Also checked in every run: the kernelized prefill logits against transformers' (fp32, max relative error)
and the two greedy generations (token for token).

The model: GLM-5's per-head geometry at a CPU size (MLA q_lora 512, kv_lora_rank 256, qk_nope 96, qk_rope 32,
v 128, 8 heads; DSA indexer 32 heads x 128, index_topk 2048 as GLM-5; 16 experts top-4 + 1 shared, hidden 512),
2 layers (1 dense + 1 MoE), fp32, sdpa attention (transformers' default), experts as transformers picks.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_kernelize.py --rounds 5 \\
        --out benchmarks/results/kernelize_cpu.json
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch
from _results import write_json  # benchmarks/, the script's folder

MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
             num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
             n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, q_lora_rank=512, kv_lora_rank=256,
             qk_nope_head_dim=96, qk_rope_head_dim=32, v_head_dim=128, index_n_heads=32, index_head_dim=128,
             index_topk=2048, max_position_embeddings=8192)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--all-logits", action="store_true",
                        help="prefill returns every position's logits (default: the last one, as generate's)")
    parser.add_argument("--out", default="benchmarks/results/kernelize_cpu.json")
    args = parser.parse_args(argv)

    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from glm5_core.integrations.transformers import kernelize

    torch.manual_seed(0)
    before = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**MODEL)).eval()
    after = kernelize(copy.deepcopy(before), backend="cpu")
    gen = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(0, MODEL["vocab_size"], (1, args.prefill_tokens), generator=gen)
    prompt = torch.randint(0, MODEL["vocab_size"], (args.batch, args.prompt_tokens), generator=gen)

    def prefill(model, logits_to_keep=0 if args.all_logits else 1):  # 1: the last position's, as generate's
        with torch.no_grad():
            return model(prefill_ids, logits_to_keep=logits_to_keep).logits

    def generate(model):
        return model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, pad_token_id=0)

    want, got = prefill(before, 0), prefill(after, 0)  # warm-up, and the parity check on every position
    rel_err = float((got - want).abs().max() / want.abs().max())
    position_err = ((got - want).double().norm(dim=-1) / want.double().norm(dim=-1)).flatten()  # [tokens]
    same_tokens = bool(torch.equal(generate(before), generate(after)))
    times = {"prefill": {"before": [], "after": []}, "generate": {"before": [], "after": []}}
    for r in range(args.rounds):
        for kind, fn in (("prefill", prefill), ("generate", generate)):
            for name, model in (("before", before), ("after", after)):
                times[kind][name].append(_seconds(lambda fn=fn, model=model: fn(model)))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {times[k]['before'][-1]:.2f}s -> {times[k]['after'][-1]:.2f}s" for k in times), file=sys.stderr)

    tokens = {"prefill": args.prefill_tokens, "generate": args.batch * args.new_tokens}
    results = {}
    for kind, by_model in times.items():
        medians = {name: statistics.median(ts) for name, ts in by_model.items()}
        results[kind] = {
            "tokens": tokens[kind],
            "median_s": medians,
            "tokens_per_s": {name: tokens[kind] / s for name, s in medians.items()},
            "speedup_of_medians": medians["before"] / medians["after"],
            "per_round_speedups": [b / a for b, a in zip(by_model["before"], by_model["after"])],
            "rounds_s": by_model,
        }
    out = {
        "command": "OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", "") + " python "
                   + " ".join(["benchmarks/bench_kernelize.py", *(argv if argv is not None else sys.argv[1:])]),
        "what": "transformers GlmMoeDsaForCausalLM before vs after kernelize(model, backend='cpu'), fp32",
        "model": MODEL,
        "prefill": {"batch": 1, "tokens": args.prefill_tokens, "logits_of": "all" if args.all_logits else "last"},
        "generate": {"batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "greedy": True},
        "rounds": args.rounds,
        "checks": {"prefill_logits_max_rel_err": rel_err,
                   "prefill_positions_with_rel_err_over_1e-5": int((position_err > 1e-5).sum()),
                   "prefill_median_position_rel_err": float(position_err.median()),
                   "generate_same_tokens": same_tokens},
        "results": results,
        "environment": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                        "machine": platform.processor() or platform.machine(),
                        "load_average_at_end": os.getloadavg()},
    }
    shown = {kind: {k: results[kind][k] for k in ("tokens_per_s", "speedup_of_medians")} for kind in results}
    write_json(args.out, out, shown=dict(shown, checks=out["checks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
