"""The extension's build states: skipped with GLM5_SKIP_EXT=1 (reference fallback, with the reason),
built and registered with fake implementations otherwise."""
import os
import subprocess
import sys

import torch

from glm5_core import testing

SKIP_SCRIPT = """
from glm5_core import registry
from glm5_core.backends.cpu import extension
status = extension.load()
assert not status.built and "GLM5_SKIP_EXT=1" in status.reason, status
rows = {r.op: r for r in registry.explain("cpu")}
assert rows["dsa_indexer_topk"].is_reference, rows["dsa_indexer_topk"]
assert "GLM5_SKIP_EXT=1" in rows["dsa_indexer_topk"].reason, rows["dsa_indexer_topk"].reason
assert "GLM5_SKIP_EXT=1" in rows["mla_prefill"].reason
import torch
from glm5_core.ops import dsa
q, k, w = torch.randn(1, 3, 2, 4), torch.randn(1, 5, 4), torch.rand(1, 3, 2)
idx = dsa.indexer_topk(q, k, w, 2, start_pos=2, backend="cpu")
assert torch.equal(idx, dsa.indexer_topk_reference(q, k, w, topk=2, start_pos=2))
print("fallback ok")
"""


def test_skip_env_falls_back_with_reason():
    env = dict(os.environ, GLM5_SKIP_EXT="1")
    result = subprocess.run([sys.executable, "-c", SKIP_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fallback ok" in result.stdout


def test_explain_names_the_native_kernels(native):
    from glm5_core import registry

    rows = {r.op: r for r in registry.explain("cpu")}
    for op in ("dsa_indexer_topk", "dsa_sparse_decode", "moe_route", "moe_dispatch", "moe_combine",
               "moe_experts", "moe_fused_experts", "dsa_sparse_prefill", "muon_orthogonalize"):
        assert rows[op].label.startswith("cpu: glm5_core.backends.cpu."), rows[op]
    assert "native extension built" in rows["mla_prefill"].reason


def test_fake_impls_trace_shapes(native):
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape = testing.IndexerShape(B=2, T=3, S=9, H=2, D=8, K=4)
    inputs = testing.make_indexer_inputs(shape)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ops = torch.ops.glm5_cpu
        idx = ops.indexer_topk(inputs["q"], inputs["k"], inputs["w"], torch.zeros(2, dtype=torch.int64), 4)
        ids = torch.zeros(5, 2, dtype=torch.int64)
        x_sorted, sort_idx, counts = ops.moe_dispatch(torch.empty(5, 3), ids, 4)
        w_gate, w_up, w_down = torch.empty(4, 2, 3), torch.empty(4, 2, 3), torch.empty(4, 3, 2)
        y = ops.moe_experts(x_sorted, counts, w_gate, w_up, w_down)
        fused = ops.moe_fused_experts(torch.empty(5, 3), torch.empty(5, 2), ids, w_gate, w_up, w_down)
    assert idx.shape == (2, 3, 4) and idx.dtype == torch.int32
    assert x_sorted.shape == (10, 3) and sort_idx.shape == (10,) and counts.shape == (4,)
    assert y.shape == (10, 3) and fused.shape == (5, 3)


def test_compiles_without_graph_break(native):
    from glm5_core.backends.cpu import dsa as native_dsa

    shape = testing.IndexerShape(B=1, T=4, S=40, H=3, D=8, K=6)
    inputs = testing.make_indexer_inputs(shape, seed=2)
    compiled = torch.compile(lambda q, k, w: native_dsa.indexer_topk(q, k, w, topk=6, start_pos=36),
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(inputs["q"], inputs["k"], inputs["w"]),
                       native_dsa.indexer_topk(inputs["q"], inputs["k"], inputs["w"], topk=6, start_pos=36))
