"""Which optimizer each parameter of a GLM-5-style model gets, decided by name and shape.

Rules, first match wins:
  1. ``requires_grad=False``                         -> excluded (frozen by the caller, or the router's
                                                        ``e_score_correction_bias``, updated by the aux-loss-free
                                                        rule and not by gradients)
  2. a DSA indexer parameter                          -> AdamW, role "indexer" (its own learning rate)
  3. rank < 2 (norm weights, biases, a trainable router bias) -> AdamW without weight decay
  4. token embeddings and the output head             -> AdamW with weight decay
  5. GLM-5.3: an mHC site's mixing projection ``*_hc.fn`` (its output is routing-like coefficients, not a
     hidden state) and a KDA layer's depthwise ``conv1d.weight`` ([C, 1, W], no matrix)  -> AdamW
  6. every other matrix                               -> Muon; with Muon Split, q_b_proj / kv_b_proj are cut into
                                                        per-head row blocks and o_proj into per-head column blocks
                                                        (MLA's heads; a KDA layer's o_proj, whose heads are
                                                        linear_num_heads, is one whole matrix, as are its
                                                        q / k / v / gate projections)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Optional

import torch

ROW_SPLIT_SUFFIXES = ("q_b_proj.weight", "kv_b_proj.weight")  # [H * d, lora]: per-head row blocks
COLUMN_SPLIT_SUFFIXES = ("o_proj.weight",)  # [hidden, H * d_v]: per-head column blocks
EMBEDDING_MARKERS = ("embed_tokens.", "lm_head.")
INDEXER_MARKER = ".indexer."
MHC_SUFFIXES = ("attn_hc.fn", "ffn_hc.fn")  # GLM-5.3's mHC sites' projections


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The optimizer one named parameter gets."""

    name: str
    param: torch.nn.Parameter
    optimizer: str  # "muon" | "adamw" | "excluded"
    role: str = "main"  # "main" | "indexer": which learning-rate schedule drives it
    weight_decay: bool = True
    split_dim: Optional[int] = None  # Muon Split: 0 row blocks, 1 column blocks, None whole matrix
    reason: str = ""


def _is_embedding(name: str) -> bool:
    return any(marker in name or name.startswith(marker) for marker in EMBEDDING_MARKERS)


def assign_parameters(model: torch.nn.Module, *, split_heads: bool = True,
                      indexer_params: Optional[Iterable[torch.nn.Parameter]] = None) -> list[Assignment]:
    """One :class:`Assignment` per named parameter of ``model`` (shared parameters counted once).

    ``indexer_params`` defaults to ``model.indexer_parameters()`` when the model has it, else to every
    parameter whose name contains ``.indexer.``.
    """
    if indexer_params is None and hasattr(model, "indexer_parameters"):
        indexer_params = model.indexer_parameters()
    indexer_ids: Optional[set[int]] = None if indexer_params is None else {id(p) for p in indexer_params}
    out: list[Assignment] = []
    kda_attention = {name[:-len("q_proj.weight")] for name, _ in model.named_parameters()
                     if name.endswith(".self_attn.q_proj.weight")}  # KDA layers (MLA has q_a_proj / q_b_proj)
    for name, p in model.named_parameters():  # named_parameters() already drops duplicates (tied weights)
        is_indexer = INDEXER_MARKER in f".{name}" if indexer_ids is None else id(p) in indexer_ids
        if not p.requires_grad:
            out.append(Assignment(name, p, "excluded", reason="requires_grad=False"))
        elif is_indexer:
            out.append(Assignment(name, p, "adamw", role="indexer", weight_decay=p.dim() >= 2, reason="DSA indexer"))
        elif p.dim() < 2:
            out.append(Assignment(name, p, "adamw", weight_decay=False, reason="vector (norm, bias)"))
        elif _is_embedding(name):
            out.append(Assignment(name, p, "adamw", reason="embedding / output head"))
        elif name.endswith(MHC_SUFFIXES):
            out.append(Assignment(name, p, "adamw", reason="mHC mixing projection"))
        elif p.dim() > 2 and name.endswith(".conv1d.weight"):
            out.append(Assignment(name, p, "adamw", weight_decay=False, reason="KDA depthwise conv"))
        elif name.endswith(".o_proj.weight") and name[:-len("o_proj.weight")] in kda_attention:
            out.append(Assignment(name, p, "muon", reason="KDA output projection (whole matrix)"))
        elif split_heads and name.endswith(ROW_SPLIT_SUFFIXES):
            out.append(Assignment(name, p, "muon", split_dim=0, reason="per-head row blocks"))
        elif split_heads and name.endswith(COLUMN_SPLIT_SUFFIXES):
            out.append(Assignment(name, p, "muon", split_dim=1, reason="per-head column blocks"))
        else:
            out.append(Assignment(name, p, "muon", reason="hidden matrix"))
    return out
