"""NoPE MLA (qk_rope_head_dim = 0): the MLA and sparse-MLA references with an empty rope slice are the functions
with the rope part zeroed, and match transformers 5.25's Glm5NextTextAttention (the module, weights copied)."""
from __future__ import annotations

import pytest
import torch

from tests.ops import nope_cases


@pytest.mark.parametrize("op", sorted(nope_cases.OPS))
def test_reference_with_no_rope_equals_zero_rope(op):
    """Dr = 0 computes what Dr = 2 does with q_pe = k_pe = 0 (the entry points accept the empty slices)."""
    entry, _, pick = nope_cases.OPS[op]
    nope = pick(nope_cases.inputs(torch.float64))
    zero = pick(nope_cases.inputs(torch.float64, rope=2))
    zero = {k: (torch.zeros_like(v) if k in ("q_pe", "k_pe") else v) for k, v in zero.items()}
    torch.testing.assert_close(entry(None, **nope), entry(None, **zero), rtol=0, atol=0)


def test_sparse_attention_matches_transformers_glm5_next_attention():
    """Our NoPE sparse MLA (absorbed reference) against transformers' eager attention of a "shared" indexer layer
    given the same top-k (fp64), both with the latent computed the same way."""
    modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    from glm5_core.ops import dsa

    H, Dn, Dv, C, Q, D = 3, 8, 6, 12, 10, 16
    cfg = Glm5NextTextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=Q,
                             kv_lora_rank=C, qk_nope_head_dim=Dn, qk_rope_head_dim=0, v_head_dim=Dv,
                             num_hidden_layers=2, layer_types=["full_attention"] * 2,
                             mlp_layer_types=["dense"] * 2, indexer_types=["full", "shared"], index_topk=4,
                             index_kpool=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = modeling.Glm5NextTextAttention(cfg, layer_idx=1).double().eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, T = 2, 7
    x = torch.randn(B, T, D, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, T, (B, T, 4), generator=g)
    idx = torch.where(idx <= torch.arange(T).view(1, T, 1), idx, -1)  # causal, -1 elsewhere
    idx[..., 0] = torch.arange(T)  # every row has a key (transformers' eager softmax of a row without one is NaN)
    idx = torch.stack([torch.stack([torch.tensor(sorted(set(r.tolist())) + [-1] * (4 - len(set(r.tolist()))))
                                    for r in row]) for row in idx])  # distinct keys per row
    want, _, _ = attn(x, attention_mask=None, prev_topk_indices=idx.to(torch.int32))

    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(B, T, H, Dn)
    c_kv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x))  # [B, T, C] (no rope columns)
    w = attn.kv_b_proj.weight.view(H, Dn + Dv, C)
    empty = x.new_zeros(B, T, H, 0)
    out = dsa.sparse_attention_reference(q, empty, c_kv, x.new_zeros(B, T, 0), w[:, :Dn], w[:, Dn:],
                                         idx.to(torch.int32), scale=Dn ** -0.5)
    got = attn.o_proj(out.reshape(B, T, H * Dv))
    # transformers' eager attention takes its softmax in fp32 (dtype=torch.float32) even for fp64 inputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
