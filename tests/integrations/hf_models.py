"""Tiny random transformers ``GlmMoeDsa`` models for the interop tests: built in the test, never downloaded.

Read against transformers' own source (``transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py``,
5.24). The models are tie-free for the indexer's top-k: ``index_n_heads`` is large enough that a key's
score ``sum_h w[h] * ReLU(q[h] . k)`` is almost never exactly 0 (ReLU zeroes about half the terms; with 32
heads all of them vanish with probability ~2^-32), so ``torch.topk`` (transformers, whose order among ties
is unspecified) and glm5-core's stable lower-index rule select the same keys. Norm weights, the indexer's
LayerNorm bias and the router's selection bias are randomised too, so a swapped or ignored one shows.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

BASE: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
    first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=6,
    num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, index_n_heads=32, index_head_dim=8, index_topk=8,
    indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=128, initializer_range=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)
SEQ_LEN = 24  # > index_topk: DSA drops keys from position index_topk on


def hf_config(**overrides: Any) -> GlmMoeDsaConfig:
    kwargs = dict(BASE)
    kwargs.update(overrides)
    if "num_hidden_layers" in overrides and "indexer_types" not in overrides:
        kwargs["indexer_types"] = ["full"] * overrides["num_hidden_layers"]
    return GlmMoeDsaConfig(**kwargs)


@torch.no_grad()
def randomise_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """Norm weights ~ 1 + N(0, 0.2), LayerNorm / selection biases ~ N(0, 0.1) (transformers inits 1 and 0)."""
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=generator))
        elif name.endswith("norm.bias") or name.endswith("e_score_correction_bias"):
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))


def hf_model(cfg: GlmMoeDsaConfig = None, seed: int = 0) -> GlmMoeDsaForCausalLM:
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg if cfg is not None else hf_config()).eval()
    randomise_norms_and_biases(model, seed)
    return model


def token_ids(vocab_size: int, batch: int = 2, seq_len: int = SEQ_LEN, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in fp64."""
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max())


def median_position_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Median over (batch, position) of ||got - want|| / ||want|| along the vocabulary, in fp64: the bf16
    comparisons' measure. In bf16 a few positions take a different discrete decision (a near-tied expert or
    DSA key) than in fp32, in transformers' own bf16 run as in glm5-core's, and their error is that of another
    function; the median measures the arithmetic everywhere else."""
    got, want = got.double(), want.double()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).median())


def glm5_model(seed: int = 0, **overrides: Any):
    """A glm5-core model from the ``tiny`` preset (its latent-norm epsilon included), shrunk, tie-free
    (32 indexer heads) and with randomised norms and selection biases; fp32, eval mode."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM

    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, first_k_dense_replace=1, intermediate_size=48,
                moe_intermediate_size=16, n_routed_experts=6, num_experts_per_tok=2, num_attention_heads=2,
                q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                rope_theta=500.0, index_n_heads=32, index_head_dim=8, index_topk=8,
                indexer_types=["full", "shared", "full", "shared"], max_position_embeddings=128,
                initializer_range=0.1)
    base.update(overrides)
    model = GLM5ForCausalLM(GLM5Config.tiny(**base), backend="cpu")
    model.reset_parameters(seed=seed)
    randomise_norms_and_biases(model, seed)
    return model.eval()
