"""glm5-core against transformers' ``Glm5NextForConditionalGeneration`` (GLM-5.3, ``glm5_next``) on the same
checkpoint, cpu, fp32.

transformers builds the model with random weights and saves it; glm5-core loads that directory
(``glm5_core.model.load_pretrained``, its language model): both run the same weights. Every part times the two
sides in interleaved rounds (transformers, glm5-core, transformers, ...) so machine load hits both alike; ratios
are of the medians over the rounds (per-round ratios kept too). Parts (``--part``, repeatable):

  * prefill: one forward without a cache over ``--prefill-shapes`` (BxT); tokens/s. Checked: the max relative
    error of the logits.
  * train: one training step (forward, LM cross-entropy, backward; no optimizer) over ``--train-shape``;
    tokens/s. glm5-core runs sparse attention (what its sparse stage trains), transformers its own forward.
  * generate: the rollout engine (``RolloutEngine(model)``, greedy) against ``model.generate(do_sample=False)``,
    batch 1 and 8 (``--batches``), ``--prompt-tokens`` prompt, ``--new-tokens`` new tokens; new tokens/s.
    Checked: the fraction of generated tokens on which the two agree.
  * memory: arithmetic, GLM-5.3-Flash's published sizes (transformers' Glm5NextTextConfig defaults): one KDA
    layer's state (conv + recurrent, fp32) against one indexed layer's cache (latent c_kv + the k-pool indexer's
    keys and gate scores, bf16) at ``--memory-tokens`` tokens, and the whole model's.

The model (``MODEL``): 4 layers (KDA, KDA, KDA, indexed: GLM-5.3's 3:1), 1 dense + 3 MoE (16 experts top-4 + 1
shared), hidden 256, 4 mHC streams, NoPE MLA with 8 heads, index_topk 64 in groups of 16 (a 32 + 64 generation
runs past it), 32 indexer heads (tie-free scores), 4 KDA heads of 64, vocabulary 4096.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_glm53_vs_transformers.py --rounds 3 \\
        --out benchmarks/results/glm53_vs_transformers_cpu.json
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
from _args import batch_tokens  # benchmarks/, the script's folder
from _results import write_json

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
             num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
             layer_types=["linear_attention"] * 3 + ["indexed_attention"], indexer_types=["full"] * 4,
             num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
             n_shared_experts=1, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=0,
             v_head_dim=32, index_n_heads=32, index_head_dim=32, index_topk=64, index_kpool=16,
             linear_num_heads=4, linear_head_dim=64, hc_mult=4, max_position_embeddings=4096, pad_token_id=0)
VISION = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=256, intermediate_size=16,
              projection_intermediate_size=16)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(sides: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    for fn in sides.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name].append(seconds(fn))
    return times


def summary(times: dict[str, list[float]], work: float, unit: str) -> dict:
    theirs, ours = times["transformers"], times["glm5_core"]
    return {f"transformers_{unit}": work / statistics.median(theirs),
            f"glm5_core_{unit}": work / statistics.median(ours),
            "speedup": statistics.median(theirs) / statistics.median(ours),
            "per_round_speedup": [t / o for t, o in zip(theirs, ours)],
            "seconds": {k: v for k, v in times.items()}}


def build(path: str):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from glm5_core.model.checkpoint import load_pretrained

    torch.manual_seed(0)
    ref = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=MODEL, vision_config=VISION))
    with torch.no_grad():  # off the init values (zeros / ones) so every parameter matters
        for name, p in ref.named_parameters():
            if "visual" not in name:
                p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(path)
    ref = Glm5NextForConditionalGeneration.from_pretrained(path).eval()
    ours = load_pretrained(path, backend="cpu").eval()
    return ref, ours


def _prefill_case(ref, ours, B: int, T: int, rounds: int) -> dict:
    ids = torch.randint(1, MODEL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(B * T))
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits, ours(ids).logits
        times = interleaved({"transformers": lambda: ref(input_ids=ids), "glm5_core": lambda: ours(ids)}, rounds)
    row = summary(times, B * T, "tokens_per_s")
    row["max_rel_error"] = ((got - want).abs().max() / want.abs().max()).item()
    return row


def part_prefill(ref, ours, shapes, rounds) -> dict:
    return {f"{B}x{T}": _prefill_case(ref, ours, B, T, rounds) for B, T in shapes}


def part_train(ref, ours, shape, rounds) -> dict:
    B, T = shape
    ids = torch.randint(1, MODEL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(7))
    ref.train()
    ours.train()

    def step_ref():
        ref.zero_grad(set_to_none=True)
        ref(input_ids=ids, labels=ids).loss.backward()

    def step_ours():
        ours.zero_grad(set_to_none=True)
        logits = ours(ids, attention="sparse").logits
        vocab = logits.shape[-1]
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()

    times = interleaved({"transformers": step_ref, "glm5_core": step_ours}, rounds)
    ref.eval()
    ours.eval()
    return {f"{B}x{T}": summary(times, B * T, "tokens_per_s")}


def _generate_case(ref, ours, B: int, prompt_tokens: int, new_tokens: int, rounds: int) -> dict:
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.protocol import GenerateRequest

    ids = torch.randint(1, MODEL["vocab_size"], (B, prompt_tokens), generator=torch.Generator().manual_seed(B))
    engine = RolloutEngine(ours, max_batch=B, max_len=prompt_tokens + new_tokens + 1)
    results: dict[str, torch.Tensor] = {}

    def run_ref():
        with torch.no_grad():
            results["transformers"] = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                                   min_new_tokens=new_tokens, pad_token_id=0)[:, prompt_tokens:]

    def run_ours():
        requests = [GenerateRequest(f"r{i}", ids[i].tolist(), temperature=0.0, max_new_tokens=new_tokens)
                    for i in range(B)]
        results["glm5_core"] = torch.tensor([r.output_ids for r in engine.generate(requests)])

    times = interleaved({"transformers": run_ref, "glm5_core": run_ours}, rounds)
    row = summary(times, B * new_tokens, "new_tokens_per_s")
    row["agreement"] = (results["transformers"] == results["glm5_core"]).float().mean().item()
    return row


def part_generate(ref, ours, batches, prompt_tokens, new_tokens, rounds) -> dict:
    return {f"batch{B}": _generate_case(ref, ours, B, prompt_tokens, new_tokens, rounds) for B in batches}


def part_memory(tokens: int) -> dict:
    """GLM-5.3-Flash's sizes (transformers 5.25 Glm5NextTextConfig defaults): 45 layers, every 4th indexed."""
    from glm5_core.model.linear_attention import state_bytes

    layers = 45
    indexed = sum(1 for i in range(layers) if i % 4 == 3)
    kda_layers = layers - indexed
    kda = state_bytes(batch_size=1, linear_num_heads=64, linear_head_dim=128, linear_conv_kernel_dim=4)
    per_token = (512 + 0) * 2 + (128 + 128) * 2  # c_kv (NoPE: no rope key) + indexer keys and gates, bf16
    mla = tokens * per_token
    return {"tokens": tokens, "kda_state_bytes_per_layer": kda, "indexed_cache_bytes_per_layer": mla,
            "kda_over_indexed": kda / mla, "layers": {"kda": kda_layers, "indexed": indexed},
            "hybrid_model_bytes": kda_layers * kda + indexed * mla, "all_indexed_model_bytes": layers * mla,
            "note": "KDA state: conv (3 x 8192 channels x 3 taps) + recurrent (64 heads x 128 x 128), fp32, "
                    "independent of the length; indexed cache: 512 latent + 128 + 128 indexer values per token, "
                    "bf16"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=("prefill", "train", "generate", "memory"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-shapes", type=batch_tokens(1), nargs="+", default=[(1, 256), (8, 256)])
    parser.add_argument("--train-shape", type=batch_tokens(2), default=(4, 256))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--memory-tokens", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/glm53_vs_transformers_cpu.json")
    args = parser.parse_args(argv)
    parts = args.part or ["prefill", "train", "generate", "memory"]
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "torch": torch.__version__,
              "transformers": transformers.__version__, "machine": platform.machine(),
              "threads": torch.get_num_threads(), "rounds": args.rounds, "model": MODEL}
    with tempfile.TemporaryDirectory() as path:
        if set(parts) - {"memory"}:
            ref, ours = build(path)
        if "prefill" in parts:
            result["prefill"] = part_prefill(ref, ours, args.prefill_shapes, args.rounds)
        if "train" in parts:
            result["train"] = part_train(ref, ours, args.train_shape, args.rounds)
        if "generate" in parts:
            result["generate"] = part_generate(ref, ours, args.batches, args.prompt_tokens, args.new_tokens,
                                               args.rounds)
    if "memory" in parts:
        result["memory"] = part_memory(args.memory_tokens)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
