"""Muon Newton-Schulz over every Muon-managed matrix of the tiny model config (GLM5Config.tiny():
hidden 128, 4 layers, 8 routed experts of FFN 96; embeddings and the output head excluded, as Muon
leaves them to AdamW), at equal steps (5) and coefficients (Keller Jordan's, torch's defaults).

  * torch_muon_loop: a loop over the matrices calling torch.optim.Muon's own Newton-Schulz
    (torch.optim._muon._zeropower_via_newtonschulz, bf16 internally, as torch.optim.Muon runs it);
  * reference / <backend>: ops.muon.orthogonalize's implementations (the reference, each requested backend's
    kernel: ``--backends``), one call per group of equal shapes (the batching our optimizer uses).
Issue-4 target: cpu >= 1.3x faster than torch_muon_loop with no worse orthogonality error
(extra_info: mean and max over the matrices of max_i |sigma_i - 1|). ``<backend>_bf16`` is the kernel
iterating in bf16 (``compute_dtype=torch.bfloat16``), as torch's does.

``test_optimizer_step``: whole ``step()`` calls, glm5's ``Muon`` (fp32 and bf16 Newton-Schulz) on each requested
backend vs ``torch.optim.Muon`` (the peer a user would pick), the same matrices and hyper-parameters.

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
from _backends import sizes, tiny

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


def _tiny_case():
    matrices = tiny_model_matrices()
    return matrices[:4] if tiny() else matrices


@pytest.mark.peers("torch_muon_loop")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_model_matrices(benchmark, impl, dtype):
    if dtype == "bf16" and impl.kind != "backend":
        pytest.skip("bf16 Newton-Schulz: timed for the backends' kernels (torch_muon_loop is bf16 already)")
    matrices = impl.to(_tiny_case())
    if impl.name == "torch_muon_loop":
        fn, name = torch_muon_loop, impl.name
    else:
        op = impl.op("muon_orthogonalize")
        compute = torch.bfloat16 if dtype == "bf16" else torch.float32
        fn = grouped(lambda G, **kw: op(G, compute_dtype=compute, **kw))
        name = f"{impl.name}_bf16" if dtype == "bf16" else impl.name
    mean_err, max_err = _ortho_errors([X.cpu() for X in fn(matrices)])
    benchmark.group = impl.group(f"muon tiny-config matrices ({len(matrices)} matrices, {STEPS} steps, jordan)")
    benchmark.extra_info.update(impl=name, kind=impl.kind, device=impl.device, matrices=len(matrices),
                                ortho_err_mean=mean_err, ortho_err_max=max_err)
    with torch.no_grad():
        benchmark.pedantic(impl.timed(lambda: fn(matrices)), rounds=7, iterations=1, warmup_rounds=1)


STEP_SHAPES = sizes([(512, 1536)] * 4 + [(1536, 512)] * 4, [(64, 192)] * 2 + [(192, 64)] * 2)


@pytest.mark.peers("torch.optim.Muon")
@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_optimizer_step(benchmark, impl, ns_dtype):
    """One ``step()`` over 4 x [512, 1536] + 4 x [1536, 512] matrices, Jordan's coefficients, 5 steps."""
    if impl.kind == "reference":
        pytest.skip("the optimizer runs a backend's kernels (the reference: compare test_tiny_model_matrices)")
    if impl.kind == "peer" and ns_dtype != "bfloat16":
        pytest.skip("torch.optim.Muon iterates in bf16 only")
    from glm5_core.optim import Muon

    hyper = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=STEPS)
    params = [torch.nn.Parameter(impl.to(testing.make_muon_input(s, seed=i))) for i, s in enumerate(STEP_SHAPES)]
    for i, p in enumerate(params):
        p.grad = impl.to(testing.make_muon_input(p.shape, seed=1000 + i))
    if impl.kind == "peer":
        opt = torch.optim.Muon(params, ns_coefficients=JORDAN.steps[0], **hyper)
        name = impl.name
    else:
        impl.op("muon_orthogonalize")  # skips where the backend would run the reference
        opt = Muon(params, coefficients="jordan", ns_dtype=ns_dtype, backend=impl.name, **hyper)
        name = f"glm5_muon_{impl.name}" + ("_bf16" if ns_dtype == "bfloat16" else "")
    benchmark.group = impl.group(f"muon optimizer step ({len(params)} matrices, {STEPS} steps, jordan)")
    benchmark.extra_info.update(impl=name, kind=impl.kind, device=impl.device, matrices=len(params))
    benchmark.pedantic(impl.timed(opt.step), rounds=7, iterations=1, warmup_rounds=1)


POLICY_SHAPES = sizes([(32, 128, 4096), (32, 64, 512), (72, 96, 128)], [(4, 32, 128)])


@pytest.mark.parametrize("shape", POLICY_SHAPES, ids=str)
@pytest.mark.parametrize("policy", ["batched", "loop"])
def test_batching_policy(benchmark, monkeypatch, backend, shape, policy):
    """One batched call vs a per-matrix loop (cpu native). Sets cpu_muon.LOOP_MIN_ELEMENTS by evidence."""
    if backend != "cpu":
        pytest.skip(f"{backend}: the batching policy is the cpu backend's")
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
