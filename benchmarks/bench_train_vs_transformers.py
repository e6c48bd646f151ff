"""One training step (forward + backward + AdamW) of glm5-core vs transformers' GlmMoeDsaForCausalLM, cpu.

transformers builds the model with random weights and saves it; glm5-core loads that checkpoint
(``load_pretrained``, backend cpu), so both start from the same weights. Per case (batch x tokens), one round
times, in an order that rotates every round so machine load hits all alike:
  * ``transformers``: its forward (its DSA: the indexer's top-k masks the attention), next-token cross entropy,
    backward, ``torch.optim.AdamW.step``; experts as ``grouped_mm`` (its fastest on CPU);
  * ``glm5_sparse``: ``attention="sparse"`` with the sparse stage's indexer KL (loss = LM + KL) against its
    default target ("selected": each head's softmax over the selected keys; ``--kl-target causal``: over every
    causal key), what ``glm5 pretrain`` runs in its sparse stage on the common step: no top-k recall
    (``measure_recall=False``: the trainer measures it every ``logging.recall_every_steps`` only); backward; AdamW;
  * ``glm5_sparse_causal`` (with ``--compare-causal``): the same step with the "causal" KL target;
  * ``glm5_dense``: ``attention="dense"`` (the first pretraining stage, no indexer KL); backward; AdamW.
Medians over the rounds; ratios are transformers' (or glm5 dense's) median over glm5's.

The measured path is checked, not assumed: every glm5-core step runs under ``registry.record_reference_runs``;
neither step may run any op through the reference (the dense step's attention is the cpu backend's ``mla_prefill``,
torch's fused CPU sdpa); anything else stops the benchmark with exit status 1 and the list.

The model: the issue's training config, 4 layers (1 dense + 3 MoE), hidden 256, 8 heads, 16 routed experts
top-4 + 1 shared, index_topk 128 (``--topk`` changes it), fp32, sdpa attention.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_train_vs_transformers.py --cases 2x512 --rounds 5 \\
        --out benchmarks/results/train_vs_transformers_2x512.json
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_train_vs_transformers.py --cases 1x4096 --topk 256 \\
        --rounds 3 --out benchmarks/results/train_vs_transformers_1x4096.json
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
import torch.nn.functional as F
from _args import batch_tokens  # benchmarks/, the script's folder
from _results import write_json

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
             n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, q_lora_rank=256, kv_lora_rank=128,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=8, index_head_dim=64,
             index_topk=128, max_position_embeddings=8192)
DENSE_REFERENCE_OK: frozenset = frozenset()  # ops the dense step may run through the reference: none


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


_parse_case = batch_tokens(2)  # BATCHxTOKENS, tokens >= 2 (the LM loss needs a next token)


def _build(topk: int, folder: str):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from glm5_core.model import load_pretrained

    torch.manual_seed(0)
    config = GlmMoeDsaConfig(**{**MODEL, "index_topk": topk})
    config._experts_implementation = "grouped_mm"
    hf = GlmMoeDsaForCausalLM(config).train()
    hf.save_pretrained(folder)
    ours = load_pretrained(folder, backend="cpu").train()
    return hf, ours


def _steps(hf, ours, ids: torch.Tensor, kl_target: str,
           compare_causal: bool) -> dict[str, Callable[[], list[tuple[str, str]]]]:
    from glm5_core import registry

    optimizers = {"transformers": torch.optim.AdamW(hf.parameters(), lr=1e-4),
                  "glm5": torch.optim.AdamW(ours.parameters(), lr=1e-4)}

    def transformers_step():
        loss = _lm_loss(hf(ids).logits, ids)
        loss.backward()
        optimizers["transformers"].step()
        optimizers["transformers"].zero_grad(set_to_none=True)
        return []

    def glm5_step(attention: str, target: str = kl_target):
        with registry.record_reference_runs() as ran:
            out = ours(ids, attention=attention, indexer_loss=attention == "sparse", indexer_kl_target=target,
                       measure_recall=False)
            loss = _lm_loss(out.logits, ids)
            if attention == "sparse":
                loss = loss + out.indexer_kl
            loss.backward()
            optimizers["glm5"].step()
            optimizers["glm5"].zero_grad(set_to_none=True)
        return ran

    steps = {"transformers": transformers_step, "glm5_sparse": lambda: glm5_step("sparse"),
             "glm5_dense": lambda: glm5_step("dense")}
    if compare_causal:
        steps["glm5_sparse_causal"] = lambda: glm5_step("sparse", "causal")
    return steps


def _check_path(name: str, ran: list[tuple[str, str]]) -> None:
    """Exit loudly when a glm5-core step computed an op with the reference it should not have."""
    allowed = DENSE_REFERENCE_OK if name == "glm5_dense" else set()
    wrong = sorted({f"{op} ({why})" for op, why in ran if op not in allowed})
    if wrong:
        print(f"{name}: ran the reference for {', '.join(wrong)}; not the kernels this benchmark names",
              file=sys.stderr)
        sys.exit(1)


def _time_case(hf, ours, batch: int, tokens: int, rounds: int, kl_target: str, compare_causal: bool) -> dict:
    ids = torch.randint(0, MODEL["vocab_size"], (batch, tokens), generator=torch.Generator().manual_seed(1))
    steps = _steps(hf, ours, ids, kl_target, compare_causal)
    names = list(steps)
    for name in names:  # warm-up, and the path check
        _check_path(name, steps[name]())
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            start = time.perf_counter()
            ran = steps[name]()
            times[name].append(time.perf_counter() - start)
            _check_path(name, ran)
        print(f"  {batch}x{tokens} round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names),
              file=sys.stderr)
    med = {n: statistics.median(v) for n, v in times.items()}
    row = {"batch": batch, "tokens": tokens, "kl_target": kl_target, "median_s": med, "times_s": times,
           "sparse_vs_transformers": med["transformers"] / med["glm5_sparse"],
           "dense_vs_transformers": med["transformers"] / med["glm5_dense"],
           "sparse_vs_glm5_dense": med["glm5_dense"] / med["glm5_sparse"]}
    if compare_causal:
        row["sparse_causal_vs_glm5_dense"] = med["glm5_dense"] / med["glm5_sparse_causal"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", type=_parse_case, default=[(2, 512)], help="BATCHxTOKENS ...")
    parser.add_argument("--topk", type=int, default=MODEL["index_topk"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--kl-target", choices=("selected", "causal"), default="selected",
                        help="the sparse step's indexer-KL target (loss.indexer_kl_target)")
    parser.add_argument("--compare-causal", action="store_true",
                        help="also time the sparse step with the causal KL target (glm5_sparse_causal)")
    parser.add_argument("--out", default="benchmarks/results/train_vs_transformers.json")
    args = parser.parse_args(argv)
    if args.topk < 1:
        parser.error(f"--topk: expected >= 1, got {args.topk}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        hf, ours = _build(args.topk, folder)
        rows = [_time_case(hf, ours, b, t, args.rounds, args.kl_target, args.compare_causal) for b, t in args.cases]
    import transformers

    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "model": {**MODEL, "index_topk": args.topk}, "rounds": args.rounds,
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__, "machine": platform.machine(),
              "load_average": os.getloadavg(), "cases": rows}
    write_json(args.out, result)
    for row in rows:
        med = row["median_s"]
        print(f"{row['batch']}x{row['tokens']}: transformers {med['transformers']:.2f}s, glm5 sparse "
              f"{med['glm5_sparse']:.2f}s ({row['sparse_vs_transformers']:.2f}x), glm5 dense {med['glm5_dense']:.2f}s "
              f"({row['dense_vs_transformers']:.2f}x); sparse vs glm5 dense {row['sparse_vs_glm5_dense']:.2f}x"
              + (f"; sparse (causal KL target) {med['glm5_sparse_causal']:.2f}s, vs glm5 dense "
                 f"{row['sparse_causal_vs_glm5_dense']:.2f}x" if "glm5_sparse_causal" in med else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
