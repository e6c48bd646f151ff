"""Training losses from a model output and a packed batch.

Legend: B rows, T positions, V vocab. A batch row holds T + 1 tokens: inputs ``row[:T]``; the main head at
position t predicts ``row[t + 1]``; MTP depth d (1-based, ``out.mtp_logits[d - 1]``) predicts
``row[t + 1 + d]``, which exists for t < T - d only (later positions are dropped).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits [B, T', V], labels int64 [B, T']."""
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1))


def mtp_loss(mtp_logits: list[torch.Tensor], rows: torch.Tensor) -> Optional[torch.Tensor]:
    """Mean over depths of the MTP cross-entropy; rows int64 [B, T + 1]. None without MTP logits."""
    T = rows.shape[1] - 1
    losses = []
    for depth, logits in enumerate(mtp_logits, start=1):
        valid = T - depth  # positions t < T - depth have a label
        if valid > 0:
            losses.append(next_token_loss(logits[:, :valid], rows[:, 1 + depth:1 + depth + valid]))
    return torch.stack(losses).mean() if losses else None
