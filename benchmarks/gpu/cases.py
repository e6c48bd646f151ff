"""Benchmark cases for the cuda backend: each builds its inputs, names the implementations to time
(our kernel, the reference, torch baselines) and counts the FLOPs and bytes one call must move.

Legend as in glm5_core.ops. ``Scale`` picks GLM-5-sized shapes ("h200") or tiny ones ("tiny", for the
CPU interpreter smoke test). FLOPs count multiply-adds as 2; bytes are the compulsory HBM traffic
(inputs read once, outputs written once), so GB/s is a lower bound on what the kernel really moves.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
import torch.nn.functional as F

from glm5_core import registry
from glm5_core.ops import dsa, mla, moe, muon


@dataclasses.dataclass
class Case:
    name: str
    shape: str
    flops: float
    bytes: float
    impls: dict[str, Callable[[], object]]
    compute_dtype: str = "bf16"  # which peak the FLOP rate is judged against


def _cuda(op):
    """The kernel of ``op`` on the benchmarked backend: ``cuda``, or the one ``bench_kernels.py --backend`` names
    (``GLM5_BENCH_BACKEND``: a Triton vendor whose kernels are the same modules with its launch table)."""
    return registry.resolve(op, os.environ.get("GLM5_BENCH_BACKEND") or "cuda").impl


def _randn(*shape, dtype, device, scale=1.0):
    return torch.randn(*shape, device=device, dtype=torch.float32).mul_(scale).to(dtype)


def indexer_case(device, tiny: bool) -> Case:
    B, T, S, H, D, K = (1, 4, 300, 4, 32, 16) if tiny else (1, 128, 65536, 32, 128, 2048)
    dt = torch.bfloat16
    q, k = _randn(B, T, H, D, dtype=dt, device=device), _randn(B, S, D, dtype=dt, device=device)
    w = _randn(B, T, H, dtype=torch.float32, device=device, scale=H ** -0.5)
    start = S - T
    scores_fn = _cuda("dsa_indexer_scores")
    impls = {
        "cuda fused top-k": lambda: _cuda("dsa_indexer_topk")(q, k, w, topk=K, start_pos=start),
        "reference (scores + stable sort)": lambda: dsa.indexer_topk_reference(q, k, w, topk=K, start_pos=start),
        "torch.topk on materialised scores": lambda: torch.topk(scores_fn(q, k, w, start_pos=start), K, dim=-1),
    }
    return Case("dsa_indexer_topk", f"B{B} T{T} S{S} H{H} D{D} K{K} bf16", 2.0 * B * T * S * H * D,
                B * S * D * 2 + B * T * (H * D * 2 + H * 4 + K * 4), impls)


def _mla_inputs(B, T, S, H, Dn, Dr, Dv, C, dt, device):
    return dict(q_nope=_randn(B, T, H, Dn, dtype=dt, device=device), q_pe=_randn(B, T, H, Dr, dtype=dt, device=device),
                c_kv=_randn(B, S, C, dtype=dt, device=device), k_pe=_randn(B, S, Dr, dtype=dt, device=device),
                w_uk=_randn(H, Dn, C, dtype=dt, device=device, scale=C ** -0.5),
                w_uv=_randn(H, Dv, C, dtype=dt, device=device, scale=C ** -0.5))


def sparse_decode_case(device, tiny: bool) -> Case:
    B, S, H, Dn, Dr, Dv, C, K = (2, 64, 16, 16, 8, 16, 32, 16) if tiny else (32, 65536, 64, 192, 64, 256, 512, 2048)
    dt = torch.bfloat16
    x = _mla_inputs(B, 1, S, H, Dn, Dr, Dv, C, dt, device)
    idx = torch.stack([torch.randperm(S, device=device)[:K] for _ in range(B)]).view(B, 1, K).to(torch.int32)
    args = [x[a] for a in ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")]
    scale = (Dn + Dr) ** -0.5
    # Absorbed MQA for SDPA: the H heads are the query rows of one KV head, so nothing is expanded.
    q_all = torch.cat([mla.absorb_query(x["q_nope"], x["w_uk"]), x["q_pe"]], -1)  # [B, 1, H, C+Dr]
    kv_all = torch.cat([x["c_kv"], x["k_pe"]], -1).unsqueeze(1)  # [B, 1, S, C+Dr]
    impls = {
        "cuda sparse decode": lambda: _cuda("dsa_sparse_decode")(*args, idx, scale=scale),
        "reference": lambda: dsa.sparse_attention_reference(*args, idx, scale=scale),
        "dense SDPA over the whole cache": lambda: F.scaled_dot_product_attention(
            q_all, kv_all, kv_all[..., :C], scale=scale),
    }
    flops = 2.0 * B * H * K * (2 * C + Dr)
    return Case("dsa_sparse_decode", f"B{B} S{S} H{H} C{C}+{Dr} K{K} bf16", flops, B * K * (C + Dr) * 2, impls,
                compute_dtype="fp32")


_PREFILL_TINY, _PREFILL_H200 = (1, 8, 32, 4, 16, 8, 16, 32, 8), (1, 1024, 4096, 16, 192, 64, 256, 512, 512)


def sparse_prefill_flops(B, T, H, Dn, Dr, Dv, C, K, backward: bool) -> float:
    """FLOPs the Triton sparse prefill executes (multiply-adds as 2), per query row r, head h, selected key k:
      forward kernel:  scores q_lat.kv (2C) + q_pe.kr (2Dr), then p @ kv (2C)                       = 4C + 2Dr
      dq kernel:       recomputed scores (2C + 2Dr), dp = dO.kv (2C), ds @ kv (2C), ds @ kr (2Dr)   = 6C + 4Dr
      dkv kernel:      recomputed scores (2C + 2Dr), dp (2C), p^T dO (2C), ds^T q_lat (2C), ds^T q_pe (2Dr)
                                                                                                     = 8C + 4Dr
    plus the torch projections per (r, h): absorb q_nope w_uk (2 Dn C) and o_lat w_uv (2 C Dv) forward, twice
    that backward (a gradient to each operand)."""
    rows_heads = B * T * H
    kernel = (4 * C + 2 * Dr) + ((6 * C + 4 * Dr) + (8 * C + 4 * Dr) if backward else 0)
    projections = 2 * C * (Dn + Dv) * (3 if backward else 1)
    return float(rows_heads * (K * kernel + projections))


def _prefill_inputs(device, tiny: bool, dt):
    B, T, S, H, Dn, Dr, Dv, C, K = _PREFILL_TINY if tiny else _PREFILL_H200
    x = _mla_inputs(B, T, S, H, Dn, Dr, Dv, C, dt, device)
    pos = torch.arange(S - T, S, device=device).view(1, T, 1)
    idx = (torch.rand(B, T, K, device=device) * (pos + 1)).long().clamp(max=S - 1).to(torch.int32)
    return x, idx, (Dn + Dr) ** -0.5


def sparse_prefill_forward_case(device, tiny: bool) -> Case:
    """Inference / forward only: bf16 inputs take the tensor-core path; fp32 inputs the exact-fp32 path."""
    B, T, S, H, Dn, Dr, Dv, C, K = _PREFILL_TINY if tiny else _PREFILL_H200
    x, idx, scale = _prefill_inputs(device, tiny, torch.bfloat16)
    x32 = {a: v.float() for a, v in x.items()}
    impls = {"cuda sparse prefill fwd (bf16 tensor cores)": lambda: _cuda("dsa_sparse_prefill")(*x.values(), idx,
                                                                                                   scale=scale),
             "cuda sparse prefill fwd (fp32 inputs, exact fp32)": lambda: _cuda("dsa_sparse_prefill")(
                 *x32.values(), idx, scale=scale),
             "reference fwd": lambda: dsa.sparse_attention_reference(*x.values(), idx, scale=scale)}
    return Case("dsa_sparse_prefill fwd", f"B{B} T{T} S{S} H{H} C{C}+{Dr} K{K} bf16",
                sparse_prefill_flops(B, T, H, Dn, Dr, Dv, C, K, backward=False), B * T * K * (C + Dr) * 2, impls)


def sparse_prefill_case(device, tiny: bool) -> Case:
    B, T, S, H, Dn, Dr, Dv, C, K = _PREFILL_TINY if tiny else _PREFILL_H200
    x, idx, scale = _prefill_inputs(device, tiny, torch.bfloat16)
    x32 = {a: v.float() for a, v in x.items()}

    def run(fn, inputs):
        params = {a: v.detach().requires_grad_() for a, v in inputs.items()}
        out = fn(*params.values(), idx, scale=scale)
        out.float().sum().backward()
        return out

    impls = {"cuda sparse prefill fwd+bwd (bf16 tensor cores)": lambda: run(_cuda("dsa_sparse_prefill"), x),
             "cuda sparse prefill fwd+bwd (fp32 inputs, exact fp32)": lambda: run(_cuda("dsa_sparse_prefill"), x32),
             "reference fwd+bwd": lambda: run(dsa.sparse_attention_reference, x)}
    return Case("dsa_sparse_prefill", f"B{B} T{T} S{S} H{H} K{K} bf16 fwd+bwd",
                sparse_prefill_flops(B, T, H, Dn, Dr, Dv, C, K, backward=True), B * T * K * (C + Dr) * 2 * 3, impls)


def attention_target_flops(B, T, S, H, Dn, Dr, C, K, start: int, normaliser: str) -> float:
    """FLOPs the Triton indexer-KL target executes (multiply-adds as 2): per query row r and head h, the absorbed
    query q_nope w_uk (2 Dn C), then per selected key the scores twice, once for the log-sum-exp and once for the
    target (2 x (2C + 2Dr)); "causal" scores every causal key once more for its log-sum-exp instead of the first
    pass (query t of a row starting at ``start`` sees min(S, start + t + 1) keys)."""
    per_key = 2 * C + 2 * Dr
    causal_keys = sum(min(S, start + t + 1) for t in range(T))  # per batch row and head
    lse_keys = causal_keys if normaliser == "causal" else T * K
    return float(B * H * (T * 2 * Dn * C + (lse_keys + T * K) * per_key))


def _target_case(device, tiny: bool, normaliser: str) -> Case:
    """The sparse stage's target at the training prefill's shape (bf16 activations; exact fp32 products)."""
    B, T, S, H, Dn, Dr, Dv, C, K = _PREFILL_TINY if tiny else _PREFILL_H200
    x, idx, scale = _prefill_inputs(device, tiny, torch.bfloat16)
    x.pop("w_uv")
    start = S - T
    kw = dict(scale=scale, start_pos=start, normaliser=normaliser)
    impls = {f"cuda target ({normaliser})": lambda: _cuda("dsa_selected_attention_target")(**x, topk_idx=idx, **kw),
             "reference": lambda: dsa.selected_attention_target_reference(**x, topk_idx=idx, **kw)}
    return Case(f"dsa_selected_attention_target {normaliser}", f"B{B} T{T} S{S} H{H} C{C}+{Dr} K{K} bf16",
                attention_target_flops(B, T, S, H, Dn, Dr, C, K, start, normaliser), B * T * K * (C + Dr) * 2, impls,
                compute_dtype="fp32")


def attention_target_case(device, tiny: bool) -> Case:
    return _target_case(device, tiny, "selected")


def attention_target_causal_case(device, tiny: bool) -> Case:
    return _target_case(device, tiny, "causal")


def route_case(device, tiny: bool) -> Case:
    N, E, K, G, TG = (40, 16, 4, 4, 2) if tiny else (65536, 256, 8, 8, 4)
    logits = _randn(N, E, dtype=torch.float32, device=device)
    bias = _randn(E, dtype=torch.float32, device=device, scale=0.01)
    kw = dict(top_k=K, n_group=G, topk_group=TG, renormalize=True, routed_scaling_factor=2.5)
    impls = {"cuda fused route": lambda: _cuda("moe_route")(logits, bias, **kw),
             "reference": lambda: moe.route_reference(logits, bias, **kw)}
    return Case("moe_route", f"N{N} E{E} K{K} groups {G}/{TG}", 0.0, N * E * 4 + N * K * 8, impls)


def permute_case(device, tiny: bool) -> Case:
    N, K, E, D = (40, 4, 8, 64) if tiny else (16384, 8, 256, 6144)
    dt = torch.bfloat16
    x = _randn(N, D, dtype=dt, device=device)
    ids = torch.randint(0, E, (N, K), device=device, dtype=torch.int32)
    w = torch.rand(N, K, device=device)
    y = _randn(N * K, D, dtype=dt, device=device)
    sort_idx = moe.dispatch_reference(x, ids, num_experts=E)[1]
    impls = {"cuda dispatch + combine": lambda: (_cuda("moe_dispatch")(x, ids, num_experts=E),
                                                 _cuda("moe_combine")(y, sort_idx, w)),
             "reference": lambda: (moe.dispatch_reference(x, ids, num_experts=E),
                                   moe.combine_reference(y, sort_idx, w))}
    return Case("moe_dispatch+combine", f"N{N} K{K} E{E} D{D} bf16", 0.0, 2 * (2 * N * K * D * 2), impls)


def _experts_inputs(device, tiny: bool):
    E, M, D, F_ = (4, 64, 32, 48) if tiny else (8, 1024, 6144, 2048)  # fp32-accumulated: keep it ~80 GFLOP
    dt = torch.bfloat16
    counts = torch.full((E,), M // E, device=device, dtype=torch.int64)
    x = _randn(M, D, dtype=dt, device=device)
    wg, wu = (_randn(E, F_, D, dtype=dt, device=device, scale=D ** -0.5) for _ in range(2))
    wd = _randn(E, D, F_, dtype=dt, device=device, scale=F_ ** -0.5)
    return (E, M, D, F_), counts, (x, wg, wu, wd)


def experts_case(device, tiny: bool) -> Case:
    (E, M, D, F_), counts, (x, wg, wu, wd) = _experts_inputs(device, tiny)
    impls = {"cuda grouped SwiGLU": lambda: _cuda("moe_experts")(x, counts, wg, wu, wd),
             "reference (per-expert torch matmuls, fp32)": lambda: moe.experts_reference(x, counts, wg, wu, wd)}
    return Case("moe_experts", f"E{E} M{M} D{D} F{F_} bf16", 6.0 * M * D * F_, (3 * E * F_ * D + 2 * M * D) * 2, impls,
                compute_dtype="fp32")


def experts_backward_flops(M, D, F_) -> float:
    """FLOPs the Triton grouped SwiGLU forward + backward executes: eleven [M, D] x [D, F]-sized GEMMs of
    2 M D F each: forward gate, up, down (3); backward recomputed gate and up (2), dh = dO Wd (1),
    dx = dg Wg + du Wu (2), dWg = dg^T x, dWu = du^T x (2), dWd = dO^T h (1)."""
    return 11 * 2.0 * M * D * F_


def experts_backward_case(device, tiny: bool) -> Case:
    (E, M, D, F_), counts, inputs = _experts_inputs(device, tiny)

    def run(fn):
        x, wg, wu, wd = (t.detach().requires_grad_() for t in inputs)
        out = fn(x, counts, wg, wu, wd)
        out.float().sum().backward()
        return out

    impls = {"cuda grouped SwiGLU fwd+bwd": lambda: run(_cuda("moe_experts")),
             "reference fwd+bwd (per-expert torch matmuls, fp32)": lambda: run(moe.experts_reference)}
    # compulsory traffic: x, dO, dx [M, D]; the three weight stacks and their gradients
    return Case("moe_experts fwd+bwd", f"E{E} M{M} D{D} F{F_} bf16", experts_backward_flops(M, D, F_),
                (6 * E * F_ * D + 4 * M * D) * 2, impls, compute_dtype="fp32")


def muon_case(device, tiny: bool) -> Case:
    Bt, m, n = (2, 16, 48) if tiny else (32, 128, 4096)
    G = _randn(Bt, m, n, dtype=torch.float32, device=device)
    schedule = muon.coefficients_for("jordan")
    from torch.optim import _muon

    impls = {"cuda batched NS (symmetric)": lambda: _cuda("muon_orthogonalize")(G, steps=5, coefficients=schedule),
             "reference (batched torch)": lambda: muon.orthogonalize_reference(G, steps=5, coefficients=schedule),
             "torch.optim.Muon NS, loop over matrices": lambda: [
                 _muon._zeropower_via_newtonschulz(G[i], schedule.steps[0], 5, 1e-7) for i in range(Bt)]}
    flops = Bt * 5 * (4.0 * m * m * n + 2.0 * m ** 3)
    return Case("muon_orthogonalize", f"{Bt} x {m}x{n} fp32, 5 steps", flops, 2 * Bt * m * n * 4, impls,
                compute_dtype="fp32")


ALL_CASES: list[Callable[[str, bool], Case]] = [indexer_case, sparse_decode_case, sparse_prefill_forward_case,
                                                sparse_prefill_case, route_case, permute_case, experts_case,
                                                experts_backward_case, attention_target_case,
                                                attention_target_causal_case, muon_case]
# The kernels training runs (forward + backward; the sparse stage's KL target), benchmarked first by run_h200.sh.
TRAINING_CASES = ("sparse_prefill_forward_case", "sparse_prefill_case", "experts_backward_case",
                  "attention_target_case")
