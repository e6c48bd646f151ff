"""Fake (meta) implementations of the ``torch.ops.glm5_cpu`` custom ops, so ``torch.compile`` and
FakeTensor tracing see their output shapes without running them. Registered once, by ``extension.load``.

Legend as in the op modules: B batch, T queries, S keys, K top-k width, H heads, C latent width, N tokens,
E experts, M = N * K routed rows, D hidden size. KDA (kda_*): K / V the key / value head dims, W the conv width.
"""
from __future__ import annotations

import torch

NATIVE_OPS = ("indexer_topk", "sparse_decode", "sparse_prefill_backward", "selected_index_scores",
              "selected_index_scores_backward", "sparse_expanded_forward", "sparse_expanded_backward",
              "selected_attention_target", "moe_select", "moe_route", "moe_dispatch",
              "moe_combine", "moe_experts",
              "moe_fused_experts", "moe_fused_experts_train", "moe_fused_experts_backward", "ns_orthogonalize",
              "kda_recurrent", "kda_causal_conv", "kda_causal_conv_backward",
              "mhc_sinkhorn_normalize")


def _indexer_topk(q, k, w, start, topk, pool=1):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32)  # [B, T, K]


def _sparse_decode(q_lat, q_pe, c_kv, k_pe, topk_idx, scale):
    return q_lat.new_empty(q_lat.shape)  # o_lat [B, T, H, C]


def _sparse_prefill_backward(grad_o_lat, q_lat, q_pe, c_kv, k_pe, topk_idx, scale):
    B, S = c_kv.shape[:2]
    return (torch.empty_like(q_lat), torch.empty_like(q_pe), q_lat.new_empty((B, S, c_kv.shape[2])),
            q_lat.new_empty((B, S, k_pe.shape[2])))  # d q_lat, d q_pe, d c_kv [B, S, C], d k_pe [B, S, R]


def _selected_index_scores(q, keys, w, topk_idx):
    return q.new_empty(topk_idx.shape)  # I_sel [B, T, K]


def _selected_index_scores_backward(grad, q, keys, w, topk_idx):
    return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(w)  # d q, d keys, d w


def _sparse_expanded_forward(q_nope, q_pe, k_nope, k_pe, v, topk_idx, scale):
    B, T, H = q_nope.shape[:3]
    return q_nope.new_empty((B, T, H, v.shape[3])), q_nope.new_empty((B, T, H))  # out [B, T, H, Dv], lse [B, T, H]


def _sparse_expanded_backward(grad_out, q_nope, q_pe, k_nope, k_pe, v, topk_idx, out, lse, scale):
    B, S, H = k_nope.shape[:3]  # d q_nope, d q_pe, d k_nope [B, S, H, Dn], d k_pe [B, S, R], d v [B, S, H, Dv]
    return (q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_pe.shape), q_nope.new_empty(k_nope.shape),
            q_nope.new_empty(k_pe.shape), q_nope.new_empty(v.shape))


def _selected_attention_target(q_nope, q_pe, k_nope, k_pe, lse, topk_idx, start, scale):
    return q_nope.new_empty(topk_idx.shape)  # p [B, T, K]


def _moe_select(select, top_k, n_group, topk_group):
    return select.new_empty((select.shape[0], top_k), dtype=torch.int64)  # [N, K]


def _moe_route(logits, bias, top_k, sigmoid, n_group, topk_group, renormalize, routed_scaling_factor):
    N = logits.shape[0]
    return logits.new_empty((N, top_k)), logits.new_empty((N, top_k), dtype=torch.int32)  # [N, K] each


def _moe_dispatch(x, expert_ids, num_experts):
    rows = expert_ids.shape[0] * expert_ids.shape[1]  # M
    return (x.new_empty((rows, x.shape[1])), x.new_empty((rows,), dtype=torch.int64),
            x.new_empty((num_experts,), dtype=torch.int64))


def _moe_combine(y_sorted, sort_idx, weights):
    return y_sorted.new_empty((weights.shape[0], y_sorted.shape[1]))  # [N, D]


def _moe_experts(x_sorted, counts, w_gate, w_up, w_down, swiglu_limit=None):
    return x_sorted.new_empty(x_sorted.shape)  # [M, D]


def _moe_fused_experts(x, weights, expert_ids, w_gate, w_up, w_down, swiglu_limit=None):
    return x.new_empty(x.shape)  # [N, D]


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _moe_fused_experts_train(x, weights, expert_ids, w_gate, w_up, w_down, swiglu_limit=None):
    rows, width = expert_ids.shape[0] * expert_ids.shape[1], w_gate.shape[1]  # M, F
    kept = x.new_empty((rows, width), dtype=_compute_dtype(x))  # gate / up [M, F]
    return (x.new_empty(x.shape), kept, torch.empty_like(kept), x.new_empty((rows,), dtype=torch.int64),
            x.new_empty((w_gate.shape[0],), dtype=torch.int64))


def _moe_fused_experts_backward(grad_out, x, weights, sort_idx, counts, gate, up, w_gate, w_up, w_down,
                                swiglu_limit=None):
    return (x.new_empty(x.shape), weights.new_empty(weights.shape), w_gate.new_empty(w_gate.shape),
            w_up.new_empty(w_up.shape), w_down.new_empty(w_down.shape))


def _ns_orthogonalize(X_wide, coeffs, loop_batch):
    return X_wide.new_empty(X_wide.shape)  # [P, m, n]


def _kda_recurrent(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    B, T, H, K = k.shape
    V = v.shape[3]  # o [B, T, H, V] in q's dtype, state [B, H, K, V] in the compute dtype
    return q.new_empty((B, T, H, V)), q.new_empty((B, H, K, V), dtype=_compute_dtype(q))


def _kda_causal_conv(x, weight, bias, conv_state, silu):
    B, T, D = x.shape  # out [B, T, D] in x's dtype, new state [B, W - 1, D] in the compute dtype
    return x.new_empty((B, T, D)), x.new_empty((B, weight.shape[1] - 1, D), dtype=_compute_dtype(x))


def _kda_causal_conv_backward(grad_out, grad_state, x, weight, bias, conv_state, silu):
    B, T, D = x.shape  # d x [B, T, D], d weight [D, W], d bias [D] or [0], d conv_state [B, W - 1, D] or [0]
    return (x.new_empty((B, T, D)), weight.new_empty(weight.shape),
            weight.new_empty((D,) if bias is not None else (0,)),
            weight.new_empty((B, weight.shape[1] - 1, D) if conv_state is not None else (0,)))


def _mhc_sinkhorn_normalize(p, iters, eps):
    return p.new_empty(p.shape)  # comb [R, N, N]


def register() -> None:
    """Attach the fake implementations (call once, after the library is loaded)."""
    impls = {"indexer_topk": _indexer_topk, "sparse_decode": _sparse_decode,
             "sparse_prefill_backward": _sparse_prefill_backward, "selected_index_scores": _selected_index_scores,
             "selected_index_scores_backward": _selected_index_scores_backward,
             "sparse_expanded_forward": _sparse_expanded_forward,
             "sparse_expanded_backward": _sparse_expanded_backward,
             "selected_attention_target": _selected_attention_target, "moe_select": _moe_select,
             "moe_route": _moe_route, "moe_dispatch": _moe_dispatch, "moe_combine": _moe_combine,
             "moe_experts": _moe_experts,
             "moe_fused_experts": _moe_fused_experts, "moe_fused_experts_train": _moe_fused_experts_train,
             "moe_fused_experts_backward": _moe_fused_experts_backward,
             "ns_orthogonalize": _ns_orthogonalize, "kda_recurrent": _kda_recurrent,
             "kda_causal_conv": _kda_causal_conv, "kda_causal_conv_backward": _kda_causal_conv_backward,
             "mhc_sinkhorn_normalize": _mhc_sinkhorn_normalize}
    for name in NATIVE_OPS:
        torch.library.register_fake(f"glm5_cpu::{name}")(impls[name])
