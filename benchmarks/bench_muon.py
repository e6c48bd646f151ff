"""Muon Newton-Schulz over every Muon-managed matrix of the tiny model config (GLM5Config.tiny():
hidden 128, 4 layers, 8 routed experts of FFN 96; embeddings and the output head excluded, as Muon
leaves them to AdamW), at equal steps (5) and coefficients (Keller Jordan's, torch's defaults).

  * torch_muon_loop: a loop over the matrices calling torch.optim.Muon's own Newton-Schulz
    (torch.optim._muon._zeropower_via_newtonschulz, bf16 internally, as torch.optim.Muon runs it);
  * reference / cpu: ops.muon.orthogonalize's implementations, one call per group of equal shapes
    (the batching our optimizer uses).
Issue-4 target: cpu >= 1.3x faster than torch_muon_loop with no worse orthogonality error
(extra_info: mean and max over the matrices of max_i |sigma_i - 1|). ``cpu_bf16`` is the cpu kernel
iterating in bf16 (``compute_dtype=torch.bfloat16``), as torch's does.

As a script (issue 15, Newton-Schulz compute dtype), whole optimizer steps, one thread, process CPU time,
the variants interleaved round by round, medians:

    python benchmarks/bench_muon.py --rounds 15 --out benchmarks/results/muon_bf16_s10.json

  * quickstart: the Quickstart's Muon (configs/tiny.yaml: polar_express, Muon Split) over the tiny model,
    ns_dtype float32 vs bfloat16;
  * vs_torch: the tiny model's Muon matrices without Muon Split, Jordan's coefficients, 5 steps:
    glm5 Muon fp32 / bf16 vs ``torch.optim.Muon`` (bf16 Newton-Schulz, one matrix at a time);
  * bigger: 4 x [512, 1536] + 4 x [1536, 512] matrices, the same three.
"""
import argparse
import collections
import statistics
import sys
import time

import pytest
import torch
from _measure import implementations

from glm5_core import registry, testing
from glm5_core.backends.cpu import muon as cpu_muon
from glm5_core.ops import muon

STEPS = 5
JORDAN = muon.COEFFICIENTS["jordan"]


def tiny_model_matrices():
    """The tiny config's Muon matrices, as gradients-like random tensors with the parameters' shapes."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    model = GLM5ForCausalLM(GLM5Config.tiny())
    shapes = [tuple(p.shape) for name, p in model.named_parameters()
              if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name]
    return [testing.make_muon_input(s, seed=i) for i, s in enumerate(shapes)]


def torch_muon_loop(matrices):
    from torch.optim._muon import _zeropower_via_newtonschulz

    a, b, c = JORDAN.steps[0]
    return [_zeropower_via_newtonschulz(G, (a, b, c), STEPS, 1e-7) for G in matrices]


def grouped(fn):
    def run(matrices):
        by_shape = collections.defaultdict(list)
        for i, G in enumerate(matrices):
            by_shape[G.shape].append(i)
        out = [None] * len(matrices)
        for idx in by_shape.values():
            result = fn(torch.stack([matrices[i] for i in idx]), steps=STEPS, coefficients=JORDAN)
            for j, i in enumerate(idx):
                out[i] = result[j]
        return out

    return run


def _ortho_errors(outputs):
    errs = torch.tensor([testing.orthogonality_error(X) for X in outputs])
    return float(errs.mean()), float(errs.max())


@pytest.mark.parametrize("name", ["torch_muon_loop", "reference", "cpu", "cpu_bf16"])
def test_tiny_model_matrices(benchmark, name):
    matrices = tiny_model_matrices()
    if name == "torch_muon_loop":
        fn = torch_muon_loop
    else:
        impls = implementations("muon_orthogonalize")
        if name.split("_")[0] not in impls:
            pytest.skip("native extension not built")
        impl = impls[name.split("_")[0]]
        dtype = torch.bfloat16 if name == "cpu_bf16" else torch.float32
        fn = grouped(lambda G, **kw: impl(G, compute_dtype=dtype, **kw))
    mean_err, max_err = _ortho_errors(fn(matrices))
    benchmark.group = f"muon tiny-config matrices ({len(matrices)} matrices, {STEPS} steps, jordan)"
    benchmark.extra_info.update(impl=name, matrices=len(matrices), ortho_err_mean=mean_err, ortho_err_max=max_err)
    with torch.no_grad():
        benchmark.pedantic(lambda: fn(matrices), rounds=7, iterations=1, warmup_rounds=1)


POLICY_SHAPES = [(32, 128, 4096), (32, 64, 512), (72, 96, 128)]


@pytest.mark.parametrize("shape", POLICY_SHAPES, ids=str)
@pytest.mark.parametrize("policy", ["batched", "loop"])
def test_batching_policy(benchmark, monkeypatch, shape, policy):
    """One batched call vs a per-matrix loop (cpu native). Sets cpu_muon.LOOP_MIN_ELEMENTS by evidence."""
    if registry.resolve("muon_orthogonalize", "cpu").is_reference:
        pytest.skip("native extension not built")
    monkeypatch.setattr(cpu_muon, "use_loop", lambda batch, m, n: policy == "loop")
    G = testing.make_muon_input(shape, seed=0)
    benchmark.group = f"muon batching policy {shape}"
    benchmark.extra_info.update(impl=policy, shape=list(shape))
    benchmark.pedantic(lambda: cpu_muon.orthogonalize(G, steps=STEPS, coefficients=JORDAN), rounds=3,
                       iterations=1, warmup_rounds=1)


# ------------------------------------------------------------------------ script: whole optimizer steps
def _quickstart_muon(ns_dtype: str):
    """The Quickstart's Muon (tiny.yaml's optimizer section) over a fresh tiny model, grads set."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.optim import MuonConfig, OptimizerConfig, build_optimizer

    torch.manual_seed(0)
    model_cfg = GLM5Config.tiny()
    cfg = OptimizerConfig(muon=MuonConfig(ns_dtype=ns_dtype))  # the defaults are tiny.yaml's muon settings
    opt = build_optimizer(GLM5ForCausalLM(model_cfg), cfg, num_heads=model_cfg.num_attention_heads, lr=5e-3,
                          backend="cpu").optimizers["muon"]
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    return opt


def _matrix_params(shapes):
    params = [torch.nn.Parameter(testing.make_muon_input(s, seed=i)) for i, s in enumerate(shapes)]
    for i, p in enumerate(params):
        p.grad = testing.make_muon_input(p.shape, seed=1000 + i)
    return params


def _three_way(shapes):
    """glm5 Muon fp32 / bf16 and torch.optim.Muon over fresh copies of the same matrices, Jordan's 5 steps."""
    from glm5_core.optim import Muon

    hyper = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=STEPS)
    return {"glm5_fp32": Muon(_matrix_params(shapes), coefficients="jordan", ns_dtype="float32", backend="cpu",
                              **hyper),
            "glm5_bf16": Muon(_matrix_params(shapes), coefficients="jordan", ns_dtype="bfloat16", backend="cpu",
                              **hyper),
            "torch_muon": torch.optim.Muon(_matrix_params(shapes), ns_coefficients=JORDAN.steps[0], **hyper)}


def _interleaved(optimizers, rounds: int):
    """{name: median process-CPU ms of one step()}, the optimizers stepped in turn each round."""
    samples = {name: [] for name in optimizers}
    for opt in optimizers.values():
        opt.step()  # warm-up: extension load, state allocation
    for _ in range(rounds):
        for name, opt in optimizers.items():
            start = time.process_time()
            opt.step()
            samples[name].append((time.process_time() - start) * 1e3)
    return {name: round(statistics.median(v), 3) for name, v in samples.items()}


def main() -> int:
    from _results import write_json

    parser = argparse.ArgumentParser(description="Muon step time by Newton-Schulz compute dtype (issue 15)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny = [tuple(G.shape) for G in tiny_model_matrices()]
    cases = {"quickstart": {n: _quickstart_muon(n) for n in ("float32", "bfloat16")},
             "vs_torch": _three_way(tiny),
             "bigger": _three_way([(512, 1536)] * 4 + [(1536, 512)] * 4)}
    medians = {case: _interleaved(opts, args.rounds) for case, opts in cases.items()}
    speedups = {case: {f"{name} / {fastest}": round(ms / m[fastest], 2) for name, ms in m.items()}
                for case, m in medians.items() for fastest in [("bfloat16" if "bfloat16" in m else "glm5_bf16")]}
    from glm5_core.ops import muon as muon_ops

    result = {"command": " ".join(["python"] + sys.argv), "rounds": args.rounds, "threads": 1,
              "clock": "time.process_time, one step() per sample, variants interleaved",
              "native_bf16_gemm": muon_ops.native_bf16_gemm(torch.device("cpu")),
              "median_ms_per_step": medians, "ratios": speedups}
    write_json(args.out, result) if args.out else print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
