"""Muon Newton-Schulz over every Muon-managed matrix of the tiny model config (GLM5Config.tiny():
hidden 128, 4 layers, 8 routed experts of FFN 96; embeddings and the output head excluded, as Muon
leaves them to AdamW), at equal steps (5) and coefficients (Keller Jordan's, torch's defaults).

  * torch_muon_loop: a loop over the matrices calling torch.optim.Muon's own Newton-Schulz
    (torch.optim._muon._zeropower_via_newtonschulz, bf16 internally, as torch.optim.Muon runs it);
  * reference / cpu: ops.muon.orthogonalize's implementations, one call per group of equal shapes
    (the batching our optimizer uses).
Issue-4 target: cpu >= 1.3x faster than torch_muon_loop with no worse orthogonality error
(extra_info: mean and max over the matrices of max_i |sigma_i - 1|).
"""
import collections

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


@pytest.mark.parametrize("name", ["torch_muon_loop", "reference", "cpu"])
def test_tiny_model_matrices(benchmark, name):
    matrices = tiny_model_matrices()
    if name == "torch_muon_loop":
        fn = torch_muon_loop
    else:
        impls = implementations("muon_orthogonalize")
        if name not in impls:
            pytest.skip("native extension not built")
        fn = grouped(impls[name])
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
