"""Speculative sampling: accept a prefix of draft tokens so that emitted tokens follow the target distribution.

Legend: B rows, d draft tokens per row, V vocabulary.

The rule of Leviathan et al. (2023, "Fast Inference from Transformers via Speculative Decoding") and Chen et al.
(2023, "Accelerating LLM Decoding with Speculative Sampling"), as vLLM's ``RejectionSampler`` applies it: draft
token ``y_j ~ q_j`` is accepted with probability ``min(1, p_j(y_j) / q_j(y_j))``; at the first rejection the
emitted token is drawn from the residual ``max(0, p_j - q_j)`` (normalised); when all d drafts are accepted a
bonus token is drawn from ``p_d``. Every emitted token then follows the target distribution ``p`` exactly.

``p`` and ``q`` are the distributions :func:`glm5_core.rl.serving.sampling.sample` draws from: the softmax of
``logits / temperature`` restricted to the top-p nucleus. Greedy rows (temperature below ``GREEDY_BELOW``) use
one-hot distributions at the argmax, which makes the same rule accept a draft iff it is the target's argmax and
emit the target's argmax otherwise: exactly plain greedy decoding.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from glm5_core.rl.serving.sampling import GREEDY_BELOW, top_p_filter


def sampling_probs(logits: torch.Tensor, temperature_B: torch.Tensor, top_p_B: Optional[torch.Tensor]) -> torch.Tensor:
    """The distribution ``sample`` draws from: [B, ..., V] logits, [B] temperature / top_p -> fp32 [B, ..., V].
    ``top_p_B`` None: every row keeps the whole vocabulary (top_p 1, no filter to run)."""
    shape = logits.shape
    B, V = shape[0], shape[-1]
    rows = logits.float().reshape(B, -1, V)  # [B, N, V]
    N = rows.shape[1]
    greedy_B = temperature_B < GREEDY_BELOW
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    scaled = (rows / temp_B.view(B, 1, 1)).reshape(B * N, V)  # [B*N, V]
    if top_p_B is not None:
        scaled = top_p_filter(scaled, top_p_B.float().repeat_interleave(N))  # top_p per row [B*N]
    probs = torch.softmax(scaled, dim=-1).reshape(B, N, V)
    one_hot = torch.zeros_like(probs).scatter_(-1, rows.argmax(-1, keepdim=True), 1.0)  # first maximum
    return torch.where(greedy_B.view(B, 1, 1), one_hot, probs).reshape(shape)


def full_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """What the engine records per token (as ``sample`` does): ``log_softmax(logits / T)`` over the full vocabulary,
    temperature 1 for greedy rows. [B, N, V], [B, N] -> fp32 [B, N]."""
    greedy_B = temperature_B < GREEDY_BELOW
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    logp = torch.log_softmax(logits.float() / temp_B.view(-1, 1, 1), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def accept_drafts(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                  generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Apply the rejection rule to every row at once.

    target_probs [B, d+1, V] (``p_j`` for the token after draft j-1; position d is the bonus), draft_tokens
    [B, d] (``y_j ~ q_j``), draft_probs [B, d, V]. Returns (tokens int64 [B, d+1]: the accepted drafts, then the
    corrected or bonus token at index ``accepted``, then padding; accepted int64 [B] in [0, d])."""
    B, d1, V = target_probs.shape
    d = d1 - 1
    if tuple(draft_tokens.shape) != (B, d) or tuple(draft_probs.shape) != (B, d, V):
        raise ValueError(f"draft_tokens / draft_probs: expected [{B}, {d}] / [{B}, {d}, {V}], got "
                         f"{tuple(draft_tokens.shape)} / {tuple(draft_probs.shape)}")
    y = draft_tokens.long()
    p_y = target_probs[:, :d].gather(-1, y.unsqueeze(-1)).squeeze(-1)  # [B, d]
    q_y = draft_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # [B, d], > 0: y was drawn from q
    u = torch.rand(B, d, generator=generator, device=target_probs.device)  # [B, d] in [0, 1)
    accept = u * q_y < p_y  # u < p / q without dividing
    accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B] leading accepted drafts
    q_padded = torch.cat((draft_probs, draft_probs.new_zeros(B, 1, V)), dim=1)  # [B, d+1, V]: q = 0 at the bonus
    idx = accepted.view(B, 1, 1).expand(B, 1, V)
    p_k = target_probs.gather(1, idx).squeeze(1)  # [B, V]
    residual = (p_k - q_padded.gather(1, idx).squeeze(1)).clamp_min(0.0)  # [B, V]
    # p == q up to rounding leaves no residual mass; then any rejection was a rounding artefact: draw from p
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_k, residual)
    next_token = torch.multinomial(residual, 1, generator=generator)  # [B, 1]
    tokens = torch.cat((y, y.new_zeros(B, 1)), dim=1).scatter_(1, accepted.unsqueeze(1), next_token)  # [B, d+1]
    return tokens, accepted
