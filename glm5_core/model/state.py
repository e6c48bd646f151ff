"""ForwardState: per-call settings and the values layers report back (created fresh by every forward)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from glm5_core.model.cache import KVCache

ATTENTION_MODES = ("dense", "sparse")


@dataclasses.dataclass
class ForwardState:
    attention: str  # "dense" | "sparse"
    start_pos: Union[int, torch.Tensor]
    cache: Optional[KVCache]
    indexer_loss: bool
    cos: torch.Tensor  # [B, T, Dr/2] for the current tokens' positions
    sin: torch.Tensor
    # with indexer_loss, sparse attention: the KL target's normaliser (indexer_loss.KL_TARGETS), and whether the
    # top-k recall is measured (it needs the dense normaliser: an extra pass with the "selected" target)
    indexer_kl_target: str = "selected"
    measure_recall: bool = True
    record_topk: bool = True  # False while the MTP module runs (no recording, no replay there)
    # replay (RL): per main MoE layer int [B, T, K] expert ids / per full-indexer layer int32 [B, T, K] top-k;
    # a row of -1 is not replayed (checked by glm5_core.model.replay before the forward)
    routing_replay: Optional[list[torch.Tensor]] = None
    index_replay: Optional[list[torch.Tensor]] = None
    shared_topk: Optional[torch.Tensor] = None  # the last full layer's top-k, int32 [B, T, K]
    # ONNX export of sparse attention: the last full layer's selection as a mask, bool [B, T, S]
    shared_selection: Optional[torch.Tensor] = None
    topk_idx: list[torch.Tensor] = dataclasses.field(default_factory=list)
    kl_terms: list[torch.Tensor] = dataclasses.field(default_factory=list)
    recall_terms: list[torch.Tensor] = dataclasses.field(default_factory=list)
    expert_counts: list[Optional[torch.Tensor]] = dataclasses.field(default_factory=list)
    expert_ids: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per main MoE layer, int32 [B, T, K]

    @property
    def fresh(self) -> bool:
        """True when the keys are exactly the current tokens (no cache, or a cache filled from slot 0)."""
        return self.cache is None or (isinstance(self.start_pos, int) and self.start_pos == 0)
