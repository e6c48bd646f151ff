"""How far the trainer's forward drifts from the rollout's, with and without routing / index replay, when the
trainer is tau policy versions ahead of the engine that sampled (async RL staleness).

    python benchmarks/rl_replay_mismatch.py --checkpoint runs/tiny/final [--samples 64] [--steps 4]
        [--seeds 0 1 2] [--out benchmarks/results/rl_replay_mismatch.json]

Policy versions: v0 is the checkpoint (the Quickstart's, by default); v1..v4 come from real RL steps
(``PolicyTrainer.train_step``, lr 3e-4 as configs/rl_tiny.yaml, 32 trajectories a step, each sampled by the engine
from the version being trained: the weight deltas are what async RL pushes). The task: continue a 48-byte window
of a Python standard library file (the pretraining data) for 48 bytes at temperature 1; the reward is the
fraction of lowercase letters in the completion (any reward would do: it only has to move the weights).

Measured set: ``--samples`` completions sampled by the engine under v0 (routing and DSA keys recorded). For
tau in (0, 1, 2, 4) the trainer's policy is v_tau and recomputes the samples three ways: no replay, routing
replay, routing + index replay. Reported per tau and way:
  * expert mismatch: fraction of positions (every position but the last of a sample) where some MoE layer's set
    of experts differs from the rollout's; also the fraction of (position, layer) pairs;
  * key mismatch: fraction of positions past index_topk (where the top-k is a real selection) where some full
    indexer layer's set of keys differs from the rollout's;
  * |logp_train - logp_rollout| over the sampled tokens: mean and max.
tau = 0 is engine vs trainer at equal weights (decode path with a KV cache vs one full forward). Each seed
repeats everything (its own RL steps and measured samples); the summary is the mean over seeds (max: largest).
Also: bytes per token of each trace, stored and on the wire (base64 JSON), here and at GLM-5's size.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from _results import write_json

from glm5_core.model import GLM5Config, load_pretrained
from glm5_core.model.replay import expert_id_dtype, key_id_dtype
from glm5_core.rl.algorithm.replay_batch import pad_traces
from glm5_core.rl.algorithm.trainer import PolicyTrainer, TrainerConfig, pad_samples, sequence_logprobs
from glm5_core.rl.rollout.trajectory import Sample, Trajectory
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest

PROMPT, NEW = 48, 48
TAUS = (0, 1, 2, 4)
WAYS = ("none", "routing", "routing+index")


def stdlib_windows(n: int, seed: int):
    """n random 48-byte windows of the standard library's .py files (byte tokens 0..255)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        data = rng.choice(files).read_bytes()
        if len(data) > PROMPT:
            start = rng.randrange(len(data) - PROMPT)
            out.append(list(data[start:start + PROMPT]))
    return out


def rollout(engine: RolloutEngine, prompts, tag: str):
    """Samples (with traces) of one completion per prompt, sampled by ``engine``."""
    requests = [GenerateRequest(f"{tag}{i}", p, temperature=1.0, max_new_tokens=NEW, return_routed_experts=True,
                                return_indexer_topk=True) for i, p in enumerate(prompts)]
    samples = []
    for request, result in zip(requests, engine.generate(requests)):
        s = Sample()
        s.append(request.input_ids, sampled=False)
        s.append(result.output_ids, sampled=True, logprobs=result.logprobs, versions=result.versions)
        s.routed_experts, s.indexer_topk = result.routed_experts, result.indexer_topk
        samples.append(s)
    return samples


def reward(sample: Sample) -> float:
    done = [t for t, m in zip(sample.tokens, sample.loss_mask) if m]
    return sum(97 <= t <= 122 for t in done) / max(len(done), 1)


def versions(model, steps: int, seed: int):
    """State dicts v0..v_steps: each step trains on 32 trajectories (4 prompts x 8) sampled from the current version."""
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    trainer = PolicyTrainer(model, TrainerConfig(lr=3e-4, micro_batch_size=32), temperature=1.0)
    for step in range(steps):
        engine = RolloutEngine(model, max_batch=32, max_len=128, seed=seed + step, record_routing=True,
                               record_index_topk=True)
        prompts = [p for p in stdlib_windows(4, seed + 100 + step) for _ in range(8)]
        samples = rollout(engine, prompts, f"train{step}-")
        trajectories = [Trajectory(f"t{i}", f"g{i // 8}", [s], reward=reward(s)) for i, s in enumerate(samples)]
        trainer.train_step(trajectories)
        model.eval()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def set_differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., layers, W] -> bool [..., layers]: the (unordered) sets differ."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


def measure(model, samples, way: str):
    cfg = model.config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    full = cfg.layer_indexer_types().count("full")
    batch = pad_samples(samples)
    routing, _ = pad_traces(samples, "routing", moe_layers, cfg.num_experts_per_tok)
    index, _ = pad_traces(samples, "index", full, cfg.index_topk)
    args = {"routing": {"routing_replay": routing},
            "routing+index": {"routing_replay": routing, "index_replay": index}}.get(way, {})
    with torch.no_grad():
        out = model(batch["input_ids"], attention="sparse", **args)
        logp, _ = sequence_logprobs(model, batch["input_ids"], 1.0, **args)
    experts, keys = torch.stack(out.expert_ids, 2).long(), torch.stack(out.topk_idx, 2).long()  # [B, T, L, W]
    pos_expert = pair_expert = pos_key = 0
    n_pos = n_pairs = n_key_pos = 0
    for row, s in enumerate(samples):
        n = len(s.tokens) - 1
        e = set_differs(experts[row, :n], routing[row, :n])  # [n, M]
        pos_expert += int(e.any(-1).sum())
        pair_expert += int(e.sum())
        n_pos += n
        n_pairs += e.numel()
        k = set_differs(keys[row, :n], index[row, :n])[cfg.index_topk:]  # positions whose top-k is a selection
        pos_key += int(k.any(-1).sum())
        n_key_pos += k.shape[0]
    mask = batch["loss_mask"].bool()
    diff = (logp - batch["rollout_logprobs"]).abs()[mask]
    return {"expert_mismatch_positions": pos_expert / max(n_pos, 1),
            "expert_mismatch_pairs": pair_expert / max(n_pairs, 1),
            "key_mismatch_positions": pos_key / max(n_key_pos, 1),
            "abs_logp_diff_mean": float(diff.mean()), "abs_logp_diff_max": float(diff.max()),
            "positions": n_pos, "selection_positions": n_key_pos, "sampled_tokens": int(mask.sum())}


def trace_bytes(samples, cfg: GLM5Config):
    """Bytes per position of each trace: stored (compact dtype) and on the wire (the JSON of the base64 form)."""
    from glm5_core.rl.serving import replay_trace

    rows = sum(s.routed_experts.shape[0] for s in samples)
    wire_r = sum(len(json.dumps(replay_trace.encode(s.routed_experts))) for s in samples)
    wire_i = sum(len(json.dumps(replay_trace.encode(s.indexer_topk))) for s in samples)
    glm5 = GLM5Config.glm5()
    glm5_moe = sum(glm5.is_moe_layer(i) for i in range(glm5.num_hidden_layers))
    glm5_full = glm5.layer_indexer_types().count("full")
    return {
        "routing_stored": samples[0].routed_experts[0].numel() * samples[0].routed_experts.element_size(),
        "routing_wire": wire_r / rows,
        "index_stored": samples[0].indexer_topk[0].numel() * samples[0].indexer_topk.element_size(),
        "index_wire": wire_i / rows,
        "glm5_routing_stored": glm5_moe * glm5.num_experts_per_tok * expert_id_dtype(glm5.n_routed_experts).itemsize,
        "glm5_index_stored": glm5_full * glm5.index_topk * key_id_dtype(glm5.max_position_embeddings).itemsize,
        "glm5_layers": {"moe": glm5_moe, "full_indexer": glm5_full, "top_k": glm5.num_experts_per_tok,
                        "index_topk": glm5.index_topk, "max_len": glm5.max_position_embeddings},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="runs/tiny/final")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one full repeat (versions, samples) each")
    parser.add_argument("--out", default="benchmarks/results/rl_replay_mismatch.json")
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        print(f"--checkpoint: expected a saved model directory (run the Quickstart first), got {args.checkpoint}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.monotonic()
    rows = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = load_pretrained(args.checkpoint, backend="cpu").eval()
        states = versions(model, args.steps, seed)
        model.load_state_dict(states[0])
        engine = RolloutEngine(model, max_batch=16, max_len=128, seed=seed + 999, record_routing=True,
                               record_index_topk=True)
        samples = rollout(engine, stdlib_windows(args.samples, seed + 7), f"measure{seed}-")  # sampled under v0
        for tau in (t for t in TAUS if t <= args.steps):
            model.load_state_dict(states[tau])
            for way in WAYS:
                rows.append({"seed": seed, "tau": tau, "replay": way, **measure(model, samples, way)})
                print(json.dumps(rows[-1]), flush=True)
    result = {"command": "python benchmarks/" + " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
              "checkpoint": args.checkpoint, "samples": args.samples, "prompt_tokens": PROMPT, "new_tokens": NEW,
              "train_steps": args.steps, "seeds": args.seeds, "mean_over_seeds": mean_over_seeds(rows),
              "rows": rows, "bytes_per_token": trace_bytes(samples, model.config),
              "seconds": round(time.monotonic() - t0, 1)}
    write_json(args.out, result, {"mean_over_seeds": result["mean_over_seeds"],
                                  "bytes_per_token": result["bytes_per_token"]})
    return 0


def mean_over_seeds(rows):
    """Per (tau, replay): the mean of each figure over the seeds (max: the largest)."""
    keys = ("expert_mismatch_positions", "expert_mismatch_pairs", "key_mismatch_positions", "abs_logp_diff_mean")
    out = []
    for tau in sorted({r["tau"] for r in rows}):
        for way in WAYS:
            group = [r for r in rows if r["tau"] == tau and r["replay"] == way]
            summary = {k: sum(r[k] for r in group) / len(group) for k in keys}
            summary["abs_logp_diff_max"] = max(r["abs_logp_diff_max"] for r in group)
            out.append({"tau": tau, "replay": way, **summary})
    return out


if __name__ == "__main__":
    sys.exit(main())
