"""MoE layer forward (route + dispatch + experts + combine) vs a per-expert Python loop of the kind
HF-style model code uses (one_hot mask, torch.where per expert, index_add_).

Issue-4 target (``--bench-large``): 4096 tokens, 64 experts, top-8, hidden 512: the glm5 MoE layer (route +
fused experts, as the model runs it, with the experts' weights already stacked) on the cpu backend >= 2x
faster than the loop. ``cpu_unfused`` runs dispatch / experts / combine as three native ops, for
comparison. The expert FFN width F is not fixed by the issue; F=128 keeps GLM-5's hidden/FFN ratio
(6144/2048 = 3) rounded to a power of two (512/4).
Routing: sigmoid scores, selection bias, renormalised, scale 2.5, as GLM-5 (one group).
"""
import pytest
import torch
import torch.nn.functional as F

from glm5_core import registry, testing
from glm5_core.ops import moe

E, TOP_K, D, FFN = 64, 8, 512, 128
SMALL = [512]
LARGE = [4096]
SCALE = 2.5


def hf_style_loop(x, logits, bias, w_gate, w_up, w_down):
    """The baseline: HF DeepseekV3-style router and expert loop."""
    scores = logits.sigmoid()  # [N, E]
    ids = torch.topk(scores + bias, TOP_K, dim=-1).indices  # [N, K]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * SCALE
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=E).permute(2, 0, 1)  # [E, N, K]
    for e in range(E):
        token, slot = torch.where(mask[e])
        if token.numel() == 0:
            continue
        h = x[token]
        y = F.linear(F.silu(F.linear(h, w_gate[e])) * F.linear(h, w_up[e]), w_down[e])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def glm5_pipeline(backend, fused: bool = True):
    """The model's MoE layer: route -> fused_experts (dispatch, grouped SwiGLU, combine), every op on ``backend``
    ('reference' = the spec). ``fused=False`` calls dispatch / experts / combine as three ops instead."""
    def op(name):
        return registry.reference(name) if backend == "reference" else registry.resolve(name, backend).impl

    route, dispatch, experts, combine, fused_experts = (
        op(n) for n in ("moe_route", "moe_dispatch", "moe_experts", "moe_combine", "moe_fused_experts"))

    def forward(x, logits, bias, w_gate, w_up, w_down):
        weights, ids = route(logits, bias, top_k=TOP_K, routed_scaling_factor=SCALE)
        if fused:
            return fused_experts(x, weights, ids, w_gate, w_up, w_down)
        x_sorted, sort_idx, counts = dispatch(x, ids, num_experts=E)
        y_sorted = experts(x_sorted, counts, w_gate, w_up, w_down)
        return combine(y_sorted, sort_idx, weights)

    return forward


def _inputs(N):
    shape = testing.MoEShape(N=N, E=E, K=TOP_K, G=1, TG=1, D=D, F=FFN)
    r = testing.make_route_inputs(shape, seed=0)
    x = testing.make_expert_inputs(shape, seed=1)
    return x["x"], r["logits"], r["bias"], x["w_gate"], x["w_up"], x["w_down"]


def _run(benchmark, name, N, rounds, warmup=1):
    args = _inputs(N)
    if name == "hf_loop":
        fn = hf_style_loop
    else:
        backend = name.replace("_unfused", "")
        if backend == "cpu" and registry.resolve("moe_dispatch", "cpu").is_reference:
            pytest.skip("native extension not built")
        fn = glm5_pipeline(backend, fused=not name.endswith("_unfused"))
    with torch.no_grad():
        torch.testing.assert_close(fn(*args), hf_style_loop(*args), atol=1e-4, rtol=1e-4)  # same function
        benchmark.group = f"moe_layer N{N} E{E} top{TOP_K} D{D} F{FFN}"
        benchmark.extra_info.update(impl=name, N=N, E=E, K=TOP_K, D=D, F=FFN)
        benchmark.pedantic(lambda: fn(*args), rounds=rounds, iterations=1, warmup_rounds=warmup)


@pytest.mark.parametrize("N", SMALL)
@pytest.mark.parametrize("name", ["hf_loop", "reference", "cpu"])
def test_moe_layer(benchmark, name, N):
    _run(benchmark, name, N, rounds=5)


@pytest.mark.large
@pytest.mark.parametrize("N", LARGE)
@pytest.mark.parametrize("name", ["hf_loop", "reference", "cpu", "cpu_unfused"])
def test_moe_layer_large(benchmark, name, N):
    # 5 warm-up calls for every implementation: glibc raises its mmap threshold only as large blocks are
    # freed, so the first few calls of any implementation pay page faults for their temporaries.
    _run(benchmark, name, N, rounds=15, warmup=5)


@pytest.mark.parametrize("part", ["route", "dispatch", "combine"])
@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_moe_parts(benchmark, name, part):
    """The ops the cpu backend implements natively, alone, at the issue's size."""
    N = LARGE[0]
    x, logits, bias, *_ = _inputs(N)
    op = registry.reference(f"moe_{part}") if name == "reference" else registry.resolve(f"moe_{part}", "cpu").impl
    if name == "cpu" and registry.resolve(f"moe_{part}", "cpu").is_reference:
        pytest.skip("native extension not built")
    weights, ids = moe.route_reference(logits, bias, top_k=TOP_K, routed_scaling_factor=SCALE)
    y_sorted = torch.randn(N * TOP_K, D)
    sort_idx = torch.randperm(N * TOP_K)
    calls = {"route": lambda: op(logits, bias, top_k=TOP_K, routed_scaling_factor=SCALE),
             "dispatch": lambda: op(x, ids, num_experts=E),
             "combine": lambda: op(y_sorted, sort_idx, weights)}
    benchmark.group = f"moe_{part} N{N} E{E} top{TOP_K} D{D}"
    benchmark.extra_info.update(impl=name, N=N)
    with torch.no_grad():
        benchmark.pedantic(calls[part], rounds=5, iterations=1, warmup_rounds=1)
