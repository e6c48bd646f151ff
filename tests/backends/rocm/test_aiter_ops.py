"""rocm's aiter paths (``glm5_core.backends.rocm.aiter_ops``): their argument building, exercised with torch
stand-ins for the two aiter calls, which need an AMD GPU."""
import torch

from glm5_core import testing
from glm5_core.ops import dsa, moe


def _fake_mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                         sm_scale=None):
    """What aiter.mla.mla_decode_fwd computes (page size 1, one query per sequence), in torch."""
    assert max_seqlen_q == 1 and bool((kv_last_page_lens == 1).all())
    C = o.shape[-1]
    for r in range(o.shape[0]):
        keys = kv_buffer[kv_indices[kv_indptr[r]:kv_indptr[r + 1]].long(), 0, 0].float()  # [n, C+Dr]
        if keys.shape[0] == 0:
            o[r] = float("nan")  # undefined for an empty sequence: the wrapper must zero it
            continue
        probs = torch.softmax(q[r].float() @ keys.T * sm_scale, dim=-1)  # [H, n]
        o[r] = (probs @ keys[:, :C]).to(o.dtype)


def test_aiter_mla_decode_argument_building():
    from glm5_core.backends.rocm import aiter_ops
    from glm5_core.backends.rocm.launch import ROCM_CONFIGS
    from glm5_core.backends.triton.table import launch_config

    shape = testing.MLAShape(B=2, T=2, S=11, H=16, Dn=8, Dr=4, Dv=6, C=24)
    x = testing.make_sparse_inputs(shape, 5, dtype=torch.float32, seed=1)
    args = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv", "topk_idx")
    out = aiter_ops.sparse_decode_with(_fake_mla_decode_fwd, *(x[a] for a in args), scale=0.3,
                                       config=launch_config(ROCM_CONFIGS, "sparse_mla"))
    ref = dsa.sparse_attention_reference(*(x[a] for a in args), scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    built = aiter_ops.build_mla_decode_args(torch.zeros(2, 2, 16, 24), x["q_pe"], x["c_kv"], x["k_pe"], x["topk_idx"])
    assert built.kv_indptr.dtype == torch.int32 and built.kv_indptr[-1] == (x["topk_idx"] >= 0).sum()
    assert built.empty_rows.tolist() == [True, False, False, False]


def _fake_biased_grouped_topk(logits, bias, weights, ids, n_group, topk_group, renorm, scaling):
    """An aiter-like routing that returns the right sets in scrambled order (ties resolved arbitrarily)."""
    w, i = moe.route_reference(logits, bias, top_k=ids.shape[1], n_group=n_group, topk_group=topk_group,
                               renormalize=renorm, routed_scaling_factor=scaling)
    flip = torch.arange(ids.shape[1] - 1, -1, -1)
    weights.copy_(w[:, flip])
    ids.copy_(i[:, flip])
    ids[0] = torch.arange(ids.shape[1] - 1, -1, -1, dtype=torch.int32) + 3  # tied row: a "wrong" pick


def _checked_biased_grouped_topk(logits, bias, weights, ids, n_group, topk_group, renorm, scaling):
    """The input contract of aiter's biased_grouped_topk kernels (csrc/kernels/topk_softmax_kernels_group.cu):
    the register-resident path (topk_group == n_group, E % 64 == 0: GLM-5's setting) and the opt-sort path
    read correction_bias in the gating dtype; n_group is one of 1, 2, 4, 8; fp32 weights, int32 ids."""
    assert bias.dtype == logits.dtype, f"bias {bias.dtype} would be read as {logits.dtype}"
    assert logits.stride(1) == 1 and weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert n_group in (1, 2, 4, 8) and 1 <= topk_group <= n_group
    w, i = moe.route_reference(logits, bias, top_k=ids.shape[1], n_group=n_group, topk_group=topk_group,
                               renormalize=renorm, routed_scaling_factor=scaling)
    weights.copy_(w)
    ids.copy_(i)


def test_aiter_routing_gets_one_dtype_for_logits_and_bias():
    from glm5_core.backends.rocm import aiter_ops
    from glm5_core.backends.rocm.launch import ROCM_CONFIGS
    from glm5_core.backends.triton.table import launch_config

    logits = testing.randn((9, 64), seed=5, dtype=torch.bfloat16)  # bf16 logits, fp32 bias: the usual checkpoint
    bias = testing.randn((64,), seed=6) * 0.1
    kwargs = dict(top_k=6, n_group=1, topk_group=1, renormalize=True, routed_scaling_factor=2.5)
    assert aiter_ops.route_supports(logits, bias, **kwargs)[0]
    weights, ids = aiter_ops.route_with(_checked_biased_grouped_topk, logits, bias,
                                        config=launch_config(ROCM_CONFIGS, "moe_route"), **kwargs)
    ref_w, ref_ids = moe.route_reference(logits, bias, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)


def test_aiter_routing_is_reordered_and_ties_recomputed():
    from glm5_core.backends.rocm import aiter_ops
    from glm5_core.backends.rocm.launch import ROCM_CONFIGS
    from glm5_core.backends.triton.table import launch_config

    logits = testing.randn((9, 16), seed=3)
    logits[0] = 0.0
    bias = torch.zeros(16)
    kwargs = dict(top_k=4, n_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5)
    weights, ids = aiter_ops.route_with(_fake_biased_grouped_topk, logits, bias,
                                        config=launch_config(ROCM_CONFIGS, "moe_route"), **kwargs)
    ref_w, ref_ids = moe.route_reference(logits, bias, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    assert aiter_ops.tie_rows(torch.sigmoid(logits) + bias, 4, 4, 2).tolist()[0] is True


def test_aiter_paths_decline_what_aiter_cannot_take():
    from glm5_core.backends.rocm import aiter_ops

    assert not aiter_ops.route_supports(torch.zeros(2, 8), None, top_k=2)[0]
    logits, bias = torch.zeros(3, 16), torch.zeros(16)
    assert aiter_ops.route_supports(logits, bias, top_k=2, n_group=4, topk_group=2)[0]
    ok, why = aiter_ops.route_supports(logits, bias, top_k=2, n_group=4, topk_group=2, renormalize=False)
    assert not ok and "need_renorm" in why  # aiter asserts it on large batches (moe_fused_gate path)
    ok, why = aiter_ops.route_supports(torch.zeros(3, 12), torch.zeros(12), top_k=2, n_group=3, topk_group=2)
    assert not ok and "num_expert_group" in why  # aiter instantiates 1, 2, 4, 8 groups only
    q = torch.zeros(1, 1, 12, 8, dtype=torch.bfloat16)
    ok, why = aiter_ops.sparse_decode_supports(q, q[..., :4], torch.zeros(1, 3, 8, dtype=torch.bfloat16),
                                               torch.zeros(1, 3, 4, dtype=torch.bfloat16), None, None,
                                               torch.zeros(1, 1, 2, dtype=torch.int32))
    assert not ok and "12" in why
