"""glm5-core against transformers' ``GlmMoeDsaForCausalLM`` on the same checkpoint, cpu, fp32.

transformers builds the model with random weights and saves it (``save_pretrained``); glm5-core loads that
directory (``glm5_core.model.load_pretrained``): both run the same weights. Every part times the two sides in
interleaved rounds (transformers, glm5-core, transformers, ...) so machine load hits both alike; ratios are of
the medians over the rounds, and the per-round ratios are kept too. Parts (``--part``, repeatable):

  * generate: the rollout engine at its defaults (``RolloutEngine(model)``, greedy requests) against
    ``model.generate(do_sample=False)`` (transformers' DynamicCache), batch 1 and 8 (``--batches``), a
    64-token prompt and 128 new tokens (``--prompt-tokens``, ``--new-tokens``); new tokens/s. Checked: the
    fraction of generated tokens on which the two agree. ``--also-decode-threads N`` adds the engine with
    ``decode_threads=N`` as a third side (batches > 1).
  * prefill: one forward without a cache over ``--prefill-shapes`` (BxT), the last position's logits (as a
    generate prefill computes them); tokens/s. Checked: the max relative error of those logits.

The model (``MODEL``): the issue-15 config, 4 layers (1 dense + 3 MoE), hidden 256, 8 heads, 16 routed experts
top-4 + 1 shared, index_topk 128 (so a 64 + 128 generation runs past it: DSA drops keys), 32 indexer heads
(tie-free scores, so both sides select the same keys), vocabulary 4096.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_vs_transformers.py --part generate --part prefill \\
        --rounds 5 --also-decode-threads 2 --out benchmarks/results/vs_transformers_cpu.json
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
from _results import write_json  # benchmarks/, the script's folder

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
             n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, q_lora_rank=256, kv_lora_rank=128,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=32, index_head_dim=32,
             index_topk=128, indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=4096,
             num_nextn_predict_layers=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


# ---- shared helpers ---------------------------------------------------------------------------------------
def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(sides: dict[str, Callable[[], object]], rounds: int, label: str) -> dict[str, list[float]]:
    """Time each side once per round, in the same order every round: {side: [seconds per round]}."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, fn in sides.items():
            times[name].append(seconds(fn))
        shown = ", ".join(f"{name} {ts[-1]:.2f}s" for name, ts in times.items())
        print(f"{label} round {r + 1}/{rounds}: {shown}", file=sys.stderr)
    return times


def summary(times: dict[str, list[float]], work: int, baseline: str = "transformers",
            candidate: str = "glm5_core") -> dict:
    """Medians, work units per second, speedup of the medians and per-round speedups (baseline / candidate)."""
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "work": work,
        "median_s": medians,
        "per_s": {name: work / s for name, s in medians.items()},
        "speedup_of_medians": medians[baseline] / medians[candidate],
        "per_round_speedups": [b / c for b, c in zip(times[baseline], times[candidate])],
        "rounds_s": times,
    }


class Models:
    """The transformers model and glm5-core's load of its checkpoint (built once, shared by the parts)."""

    def __init__(self, model_overrides: dict = None):
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        from glm5_core.model import load_pretrained

        self.spec = dict(MODEL, **(model_overrides or {}))
        torch.manual_seed(0)
        self.transformers = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**self.spec)).eval()
        with tempfile.TemporaryDirectory() as path:
            self.transformers.save_pretrained(path)
            self.glm5 = load_pretrained(path, backend="cpu").eval()


# ---- part: generate ---------------------------------------------------------------------------------------
def part_generate(models: Models, args) -> dict:
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.protocol import GenerateRequest

    vocab = models.spec["vocab_size"]
    out = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "greedy": True, "batches": {}}
    for batch in args.batches:
        prompt = torch.randint(0, vocab, (batch, args.prompt_tokens), generator=torch.Generator().manual_seed(batch))
        engine = RolloutEngine(models.glm5)  # its defaults (max_batch 8, max_len = max_position_embeddings)
        requests = [GenerateRequest(rid=f"r{i}", input_ids=prompt[i].tolist(), temperature=0.0,
                                    max_new_tokens=args.new_tokens) for i in range(batch)]

        def hf_generate(prompt=prompt):
            return models.transformers.generate(prompt, max_new_tokens=args.new_tokens,
                                                min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

        def engine_generate(engine=engine, requests=requests):
            results = engine.generate(requests)
            for request in requests:  # each round a fresh trajectory: no prefix-cache reuse between rounds
                engine.end_trajectory(request.rid)
            return results

        want = hf_generate()[:, args.prompt_tokens:]  # warm-up, and the agreement check
        got = torch.tensor([r.output_ids for r in engine_generate()])
        agree = float((got == want).float().mean())
        first_diff = [int((g != w).nonzero()[0]) if bool((g != w).any()) else None for g, w in zip(got, want)]
        sides = {"transformers": hf_generate, "glm5_core": engine_generate}
        if args.also_decode_threads and batch > 1:  # the same engine with concurrent decode groups, for contrast
            variant = RolloutEngine(models.glm5, decode_threads=args.also_decode_threads)
            name = f"glm5_core_decode_threads_{args.also_decode_threads}"

            def variant_generate(variant=variant, requests=requests):
                results = variant.generate(requests)
                for request in requests:
                    variant.end_trajectory(request.rid)
                return results

            variant_generate()  # warm-up
            sides[name] = variant_generate
        times = interleaved(sides, args.rounds, f"generate B={batch}")
        result = dict(summary(times, batch * args.new_tokens), token_agreement=agree,
                      first_divergence_per_row=first_diff)
        for name in sides:
            if name.startswith("glm5_core_"):
                result[f"speedup_of_medians_{name}"] = summary(times, 1, candidate=name)["speedup_of_medians"]
        out["batches"][str(batch)] = result
    return out


# ---- part: prefill ----------------------------------------------------------------------------------------
def part_prefill(models: Models, args) -> dict:
    vocab = models.spec["vocab_size"]
    out = {"logits_of": "last", "shapes": {}}
    for shape in args.prefill_shapes:
        B, T = (int(x) for x in shape.lower().split("x"))
        ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(T))

        @torch.no_grad()
        def hf_prefill(ids=ids):
            return models.transformers(ids, logits_to_keep=1).logits[:, -1]

        @torch.no_grad()
        def glm5_prefill(ids=ids):
            return models.glm5(ids).logits[:, -1]

        want, got = hf_prefill(), glm5_prefill()
        rel_err = float((got - want).abs().max() / want.abs().max())
        times = interleaved({"transformers": hf_prefill, "glm5_core": glm5_prefill}, args.rounds, f"prefill {shape}")
        out["shapes"][shape] = dict(summary(times, B * T), last_logits_max_rel_err=rel_err)
    return out


# ---- parts table: another part adds itself here ------------------------------------------------------------
PARTS: dict[str, Callable[[Models, argparse.Namespace], dict]] = {
    "generate": part_generate,
    "prefill": part_prefill,
}


def _shown(result: dict) -> dict:
    """The speedups only, for the terminal."""
    if isinstance(result, dict):
        if "speedup_of_medians" in result:
            return {k: result[k] for k in ("per_s", "speedup_of_medians", "token_agreement",
                                           "last_logits_max_rel_err") if k in result}
        return {k: _shown(v) for k, v in result.items() if isinstance(v, dict)}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=sorted(PARTS),
                        help="which comparison to run (repeatable; default: all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-shapes", nargs="+", default=["1x512", "4x512"])
    parser.add_argument("--also-decode-threads", type=int, default=0,
                        help="generate: also time the engine with decode_threads=N (batches > 1), for contrast")
    parser.add_argument("--out", default="benchmarks/results/vs_transformers_cpu.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected >= 1, got {args.rounds}")

    models = Models()
    parts = args.part or list(PARTS)
    results = {name: PARTS[name](models, args) for name in parts}
    out = {
        "command": "OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", "") + " python "
                   + " ".join(["benchmarks/bench_vs_transformers.py", *(argv if argv is not None else sys.argv[1:])]),
        "what": "glm5-core vs transformers GlmMoeDsaForCausalLM on the same checkpoint, cpu, fp32",
        "model": models.spec,
        "rounds": args.rounds,
        "results": results,
        "environment": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                        "machine": platform.processor() or platform.machine(),
                        "load_average_at_end": os.getloadavg()},
    }
    write_json(args.out, out, shown=_shown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
