"""MoE layer forward + backward (routing + routed experts, as in training) on the cpu backend vs the reference
vs transformers' ``grouped_mm`` experts, on the same weights.

    python benchmarks/bench_moe_train.py [--tokens 1024] [--experts 16 64 256] [--rounds 5]

Each implementation runs router logits -> top-k routing -> routed SwiGLU experts -> loss = <out, g>, then
backward to the tokens, the router weight and every expert weight:
- ``glm5_cpu``: ``moe_route`` + ``moe_fused_experts`` resolved on the cpu backend (native forward and
  backward); the script fails if either call falls back to the reference.
- ``reference``: ``route_reference`` + ``fused_experts_reference`` (what training ran before the native backward).
- ``transformers_grouped_mm``: transformers' ``GlmMoeDsaTopkRouter`` and ``GlmMoeDsaExperts`` with
  ``_experts_implementation = "grouped_mm"`` (``transformers.integrations.moe.grouped_mm_experts_forward``), its
  fastest CPU experts; gate and up concatenated into ``gate_up_proj`` [E, 2F, D] as transformers stores them.
Rounds are interleaved (every implementation once per round, order rotating) and medians reported; the
outputs and gradients are checked to agree before timing. The reference is timed only up to
``--reference-up-to`` experts (default 64; beyond, one step takes minutes on 2 cores). Writes
``benchmarks/results/moe_train_cpu.json`` (with the command).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._results import write_json  # noqa: E402
from glm5_core import registry  # noqa: E402
from glm5_core.ops import moe  # noqa: E402

TOP_K, D, FFN, SCALE = 8, 512, 128, 2.5
RESULT = "benchmarks/results/moe_train_cpu.json"


def make_weights(E: int, N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(N, D, generator=g),
        "router": torch.randn(E, D, generator=g) * D ** -0.5,
        "bias": torch.randn(E, generator=g) * 0.01,
        "w_gate": torch.randn(E, FFN, D, generator=g) * D ** -0.5,
        "w_up": torch.randn(E, FFN, D, generator=g) * D ** -0.5,
        "w_down": torch.randn(E, D, FFN, generator=g) * FFN ** -0.5,
        "grad": torch.randn(N, D, generator=g),
    }


def glm5_step(w, backend):
    """One forward + backward; returns (out, grads of x, router, w_gate, w_up, w_down)."""
    leaves = {k: w[k].clone().requires_grad_(True) for k in ("x", "router", "w_gate", "w_up", "w_down")}
    if backend == "reference":
        route, fused = moe.route_reference, moe.fused_experts_reference
    else:
        route = registry.resolve("moe_route", backend).impl
        fused = registry.resolve("moe_fused_experts", backend).impl
    logits = leaves["x"] @ leaves["router"].T  # [N, E]
    weights, ids = route(logits, w["bias"], top_k=TOP_K, routed_scaling_factor=SCALE)
    out = fused(leaves["x"], weights, ids, leaves["w_gate"], leaves["w_up"], leaves["w_down"])
    out.backward(w["grad"])
    return out, [leaves[k].grad for k in ("x", "router", "w_gate", "w_up", "w_down")]


def transformers_modules(w):
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaExperts, GlmMoeDsaTopkRouter

    E = w["router"].shape[0]
    config = GlmMoeDsaConfig(hidden_size=D, moe_intermediate_size=FFN, n_routed_experts=E, num_experts_per_tok=TOP_K,
                             n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=SCALE)
    config._experts_implementation = "grouped_mm"
    router, experts = GlmMoeDsaTopkRouter(config), GlmMoeDsaExperts(config)
    with torch.no_grad():
        router.weight.copy_(w["router"])
        router.e_score_correction_bias.copy_(w["bias"])
        experts.gate_up_proj.copy_(torch.cat([w["w_gate"], w["w_up"]], dim=1))  # [E, 2F, D]
        experts.down_proj.copy_(w["w_down"])
    return router, experts


def transformers_step(w, modules):
    router, experts = modules
    for p in (*router.parameters(), *experts.parameters()):
        p.grad = None
    x = w["x"].clone().requires_grad_(True)
    _, topk_weights, topk_indices = router(x)
    out = experts(x, topk_indices, topk_weights)
    out.backward(w["grad"])
    F = FFN
    gate_up = experts.gate_up_proj.grad
    return out, [x.grad, router.weight.grad, gate_up[:, :F], gate_up[:, F:], experts.down_proj.grad]


def check_agree(results):
    """Outputs and gradients of every implementation against the first (fp32 tolerances, relative to max)."""
    _, (ref_out, ref_grads) = results[0]
    for name, (out, grads) in results[1:]:
        for label, got, want in zip(("out", "x", "router", "w_gate", "w_up", "w_down"), [out] + grads,
                                    [ref_out] + ref_grads):
            scale = float(want.detach().abs().max()) or 1.0
            err = float((got.detach() - want.detach()).abs().max()) / scale
            if err > 1e-4:
                raise SystemExit(f"{name}: {label} differs from {results[0][0]} by {err:.2e} (relative to max)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reference-up-to", type=int, default=64,
                        help="time the reference only up to this many experts (it takes minutes per step beyond)")
    parser.add_argument("--out", default=RESULT)
    args = parser.parse_args(argv)
    if args.tokens <= 0 or args.rounds <= 0 or any(e < TOP_K for e in args.experts):
        parser.error(f"--tokens and --rounds must be positive and every --experts >= top-k {TOP_K}")

    cases = {}
    for E in args.experts:
        w = make_weights(E, args.tokens)
        modules = transformers_modules(w)
        impls = {"reference": lambda w=w: glm5_step(w, "reference"),
                 "glm5_cpu": lambda w=w: glm5_step(w, "cpu"),
                 "transformers_grouped_mm": lambda w=w, m=modules: transformers_step(w, m)}
        if E > args.reference_up_to:
            del impls["reference"]  # checked against transformers instead
        with registry.record_fallbacks() as fallbacks:
            results = [(name, fn()) for name, fn in impls.items()]  # also the warm-up
        if fallbacks:
            raise SystemExit(f"glm5_cpu fell back to the reference: {fallbacks}")
        check_agree(results)
        cases[E] = impls

    times = {E: {name: [] for name in impls} for E, impls in cases.items()}
    for r in range(args.rounds):
        for E, impls in cases.items():
            names = list(impls)
            names = names[r % len(names):] + names[:r % len(names)]  # rotate the order each round
            for name in names:
                start = time.perf_counter()
                impls[name]()
                times[E][name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    rows = []
    for E, per_impl in times.items():
        med = {name: statistics.median(t) for name, t in per_impl.items()}
        rows.append({"experts": E, "tokens": args.tokens, "median_s": med, "all_s": per_impl,
                     "glm5_vs_grouped_mm": med["transformers_grouped_mm"] / med["glm5_cpu"],
                     "glm5_vs_reference": med["reference"] / med["glm5_cpu"] if "reference" in med else None})
    result = {
        "command": "python benchmarks/bench_moe_train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "what": "MoE layer forward + backward (routing + routed experts), fp32, seconds per step",
        "hidden": D, "ffn": FFN, "top_k": TOP_K, "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "rounds": args.rounds, "results": rows,
    }
    shown = [{k: row[k] for k in ("experts", "median_s", "glm5_vs_grouped_mm", "glm5_vs_reference")} for row in rows]
    write_json(args.out, result, shown)


if __name__ == "__main__":
    main()
