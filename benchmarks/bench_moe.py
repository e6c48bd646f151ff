"""MoE layer forward (route + dispatch + experts + combine): the reference and each requested backend
(``--backends``) vs two peers: a per-expert Python loop of the kind HF-style model code uses (one_hot mask,
torch.where per expert, index_add_: ``hf_loop``) and transformers' own router + experts with its fastest experts
path, ``grouped_mm`` (``transformers_grouped_mm``).

Issue-4 target (``--bench-large``): 4096 tokens, 64 experts, top-8, hidden 512: the glm5 MoE layer (route +
fused experts, as the model runs it, with the experts' weights already stacked) on the cpu backend >= 2x
faster than the loop. ``<backend>_unfused`` runs dispatch / experts / combine as three native ops, for
comparison. The expert FFN width F is not fixed by the issue; F=128 keeps GLM-5's hidden/FFN ratio
(6144/2048 = 3) rounded to a power of two (512/4).
Routing: sigmoid scores, selection bias, renormalised, scale 2.5, as GLM-5 (one group).
"""
import pytest
import torch
import torch.nn.functional as F
from _backends import Impl, sizes

from glm5_core import testing
from glm5_core.ops import moe

E, TOP_K, D, FFN = 64, 8, 512, 128
SMALL = sizes([512], [64])
LARGE = sizes([4096], [128])
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


def glm5_pipeline(op, fused: bool = True):
    """The model's MoE layer: route -> fused_experts (dispatch, grouped SwiGLU, combine), each op what ``op(name)``
    returns (``Impl.op``: the reference or a backend's kernel). ``fused=False`` calls dispatch / experts / combine
    as three ops instead."""
    names = ("moe_route", "moe_fused_experts") if fused else ("moe_route", "moe_dispatch", "moe_experts", "moe_combine")
    ops = {name: op(name) for name in names}

    def forward(x, logits, bias, w_gate, w_up, w_down):
        weights, ids = ops["moe_route"](logits, bias, top_k=TOP_K, routed_scaling_factor=SCALE)
        if fused:
            return ops["moe_fused_experts"](x, weights, ids, w_gate, w_up, w_down)
        x_sorted, sort_idx, counts = ops["moe_dispatch"](x, ids, num_experts=E)
        y_sorted = ops["moe_experts"](x_sorted, counts, w_gate, w_up, w_down)
        return ops["moe_combine"](y_sorted, sort_idx, weights)

    return forward


def transformers_grouped_mm(router_weight, bias, w_gate, w_up, w_down):
    """transformers' ``GlmMoeDsaTopkRouter`` + ``GlmMoeDsaExperts`` with ``_experts_implementation = "grouped_mm"``
    (its fastest experts path) on the same weights; called as the others, it recomputes the router logits from
    ``x`` (one [N, D] x [D, E] GEMM, ~2% of the experts' work here)."""
    try:
        from transformers import GlmMoeDsaConfig
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaExperts, GlmMoeDsaTopkRouter
    except ImportError as exc:
        pytest.skip(f"transformers_grouped_mm: transformers with GlmMoeDsa is not installed "
                    f"(pip install 'glm5-core[bench]'): {exc}")
    config = GlmMoeDsaConfig(hidden_size=D, moe_intermediate_size=FFN, n_routed_experts=E, num_experts_per_tok=TOP_K,
                             n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=SCALE)
    config._experts_implementation = "grouped_mm"
    router, experts = GlmMoeDsaTopkRouter(config), GlmMoeDsaExperts(config)
    with torch.no_grad():
        router.weight.copy_(router_weight)
        router.e_score_correction_bias.copy_(bias)
        experts.gate_up_proj.copy_(torch.cat([w_gate, w_up], dim=1))  # [E, 2F, D], as transformers stores them
        experts.down_proj.copy_(w_down)
    router, experts = router.to(w_gate.device), experts.to(w_gate.device)

    def forward(x, logits, bias, w_gate, w_up, w_down):
        _, weights, ids = router(x)
        return experts(x, ids, weights)

    return forward


def _inputs(N):
    shape = testing.MoEShape(N=N, E=E, K=TOP_K, G=1, TG=1, D=D, F=FFN)
    r = testing.make_route_inputs(shape, seed=0)
    x = testing.make_expert_inputs(shape, seed=1)
    router = torch.randn(E, D, generator=testing.generator(2)) * D ** -0.5
    logits = F.linear(x["x"], router)  # the router's logits, so transformers' router (which computes them) agrees
    return (x["x"], logits, r["bias"], x["w_gate"], x["w_up"], x["w_down"]), router


def _run(benchmark, impl: Impl, N, rounds, warmup=1, fused=True):
    args, router = _inputs(N)
    args, router = impl.to(args), impl.to(router)
    if impl.name == "hf_loop":
        fn = hf_style_loop
    elif impl.name == "transformers_grouped_mm":
        fn = transformers_grouped_mm(router, *args[2:])
    else:
        # unfused: the layer's parts as the backend resolves them; the dispatch must be its own
        fn = glm5_pipeline(lambda op: impl.op(op, required=fused or op == "moe_dispatch"), fused=fused)
    name = impl.name if fused else f"{impl.name}_unfused"
    with torch.no_grad():
        torch.testing.assert_close(fn(*args), hf_style_loop(*args), atol=1e-4, rtol=1e-4)  # same function
        benchmark.group = impl.group(f"moe_layer N{N} E{E} top{TOP_K} D{D} F{FFN}")
        benchmark.extra_info.update(impl=name, kind=impl.kind, device=impl.device, N=N, E=E, K=TOP_K, D=D, F=FFN)
        benchmark.pedantic(impl.timed(lambda: fn(*args)), rounds=rounds, iterations=1, warmup_rounds=warmup)


@pytest.mark.peers("hf_loop", "transformers_grouped_mm")
@pytest.mark.parametrize("N", SMALL)
def test_moe_layer(benchmark, impl, N):
    _run(benchmark, impl, N, rounds=5)


@pytest.mark.large
@pytest.mark.peers("hf_loop", "transformers_grouped_mm")
@pytest.mark.parametrize("N", LARGE)
def test_moe_layer_large(benchmark, impl, N):
    # 5 warm-up calls for every implementation: glibc raises its mmap threshold only as large blocks are
    # freed, so the first few calls of any implementation pay page faults for their temporaries.
    _run(benchmark, impl, N, rounds=15, warmup=5)


@pytest.mark.large
@pytest.mark.parametrize("N", LARGE)
def test_moe_layer_unfused_large(benchmark, backend, N):
    """Each backend's dispatch / experts / combine as three ops, for comparison (same group as the fused layer)."""
    from glm5_core import registry

    _run(benchmark, Impl(backend, "backend", registry.get_backend(backend).device()), N, rounds=15, warmup=5,
         fused=False)


@pytest.mark.parametrize("part", ["route", "dispatch", "combine"])
def test_moe_parts(benchmark, impl, part):
    """The ops alone, at the issue's size (the tiny size under GLM5_BENCH_TINY=1)."""
    N = LARGE[0]
    (x, logits, bias, *_), _ = impl.to(_inputs(N))
    op = impl.op(f"moe_{part}")
    weights, ids = moe.route_reference(logits, bias, top_k=TOP_K, routed_scaling_factor=SCALE)
    y_sorted = impl.to(torch.randn(N * TOP_K, D))
    sort_idx = impl.to(torch.randperm(N * TOP_K))
    calls = {"route": lambda: op(logits, bias, top_k=TOP_K, routed_scaling_factor=SCALE),
             "dispatch": lambda: op(x, ids, num_experts=E),
             "combine": lambda: op(y_sorted, sort_idx, weights)}
    benchmark.group = impl.group(f"moe_{part} N{N} E{E} top{TOP_K} D{D}")
    benchmark.extra_info.update(impl=impl.name, kind=impl.kind, device=impl.device, N=N)
    with torch.no_grad():
        benchmark.pedantic(impl.timed(calls[part]), rounds=5, iterations=1, warmup_rounds=1)
