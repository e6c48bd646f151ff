"""torch.compile of the model (cpu backend, small configs; compiling is slow on 2 cores).

The layers bind their kernels when built, so the op calls trace without touching the registry's resolution
(no imports, environment reads or context variables), and the cpu backend's native ops are torch.library
custom ops with fake implementations (``backends/cpu/fake_impls.py``): an inference forward is one graph,
``fullgraph=True``.

A training forward (gradients on) still breaks, but only inside references: the native dispatch, experts,
combine, sparse-attention and top-k kernels have no backward, so the registry routes those calls to the
differentiable references, which have data-dependent shapes (the per-expert row counts of the dispatch and
the grouped experts, the NaN check of the top-k) that dynamo cannot trace into one graph. The break sites are
tested: none at an op boundary (registry, entry points, kernels, model code).
"""
from __future__ import annotations

import collections

import pytest
import torch

from glm5_core import registry


def _two_layer_config(make_config, first_dense: int = 1):
    return make_config(num_hidden_layers=2, first_k_dense_replace=first_dense, indexer_types=["full", "shared"],
                       num_nextn_predict_layers=0)


def _break_sites(explanation):
    """(file under glm5_core/, function) of the innermost glm5_core frame of each graph break."""
    sites = collections.Counter()
    for reason in explanation.break_reasons:
        frames = [f for f in reason.user_stack if "glm5_core" in f.filename]
        sites[(frames[-1].filename.split("glm5_core/")[-1], frames[-1].name) if frames else ("?", "?")] += 1
    return sites


@pytest.mark.slow
@pytest.mark.parametrize("attention", ("dense", "sparse"))
def test_inference_forward_compiles_to_one_graph(attention, make_model, make_config):
    torch._dynamo.reset()
    cfg = _two_layer_config(make_config)
    model = make_model(cfg, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        explanation = torch._dynamo.explain(lambda i: model(i, attention=attention).logits)(ids)
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), _break_sites(explanation)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert torch.equal(compiled(ids, attention=attention).logits, model(ids, attention=attention).logits)
    torch._dynamo.reset()


@pytest.mark.slow
def test_training_forward_breaks_only_inside_references(make_model, make_config):
    torch._dynamo.reset()
    cfg = _two_layer_config(make_config)
    model = make_model(cfg, torch.float32).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    explanation = torch._dynamo.explain(lambda i: model(i, attention="sparse").logits)(ids)
    torch._dynamo.reset()
    sites = _break_sites(explanation)
    references = {spec.reference.__name__ for spec in registry.op_specs().values()}
    for (where, function), _ in sites.items():
        assert where.startswith("ops/") and (function in references or function.startswith("_")), sites
    assert {f for _, f in sites} <= {"dispatch_reference", "experts_reference", "_topk_from_scores"}, sites


@pytest.mark.slow
@pytest.mark.parametrize("first_dense, compile_backend", [(2, "inductor"), (1, "aot_eager")])
def test_compiled_forward_matches_eager(first_dense, compile_backend, make_model, make_config):
    torch._dynamo.reset()
    cfg = _two_layer_config(make_config, first_dense)
    model = make_model(cfg, torch.float32)
    compiled = torch.compile(model, backend=compile_backend)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for T in (12, 12):  # second call reuses the compiled graphs
            ids = torch.randint(0, cfg.vocab_size, (2, T), generator=gen)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
