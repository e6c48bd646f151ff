"""The replay traces a rollout engine returns: per position, the experts each MoE layer chose (routing replay)
and the keys each full-indexer layer selected (DSA index replay).

Legend: P positions of a finished request (prompt + completion - 1: every token but the last, which the engine
never ran), M main MoE layers, K experts per token, F full-indexer layers, Ki index_topk.

* Recorded in the engine's KV cache (``model.new_cache(record_routing=..., record_index_topk=...)``), so the
  prefix cache and the slot copies carry them with the KV: a finished request's trace covers its whole
  sequence, prefix-cache hits included, like SGLang's ``routed_experts`` (which slime replays).
* On the wire (``meta_info.routed_experts`` / ``meta_info.indexer_topk``), SGLang 0.5.23's form
  (``sglang/srt/state_capturer/{routed_experts,indexer_topk}.py``, ``tokenizer_manager.py``): a bare base64 string
  of the little-endian int32 array ``[P, num_hidden_layers, K]`` (routed experts; the rows of dense layers are 0,
  as SGLang's zeroed capture buffer leaves them) / ``[P, num_hidden_layers, Ki]`` (indexer keys: every layer a row,
  a "shared" layer repeating the keys of the full layer it reuses, as SGLang mirrors them; -1 padding). The
  receiver knows P (its tokens) and reshapes with the model's layout (:class:`TraceLayout`), as slime does.
* :func:`decode` treats the payload as untrusted: the string's length is capped and checked against whole int32
  rows of P positions before anything is decoded, base64 validated.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from typing import Any, Optional

import numpy as np
import torch

MAX_TRACE_BYTES = 256 * 2 ** 20  # one response's trace: far above any engine's max_len x layers x width


def read(stores, slot: int, length: int) -> Optional[torch.Tensor]:
    """Positions ``[0, length)`` of row ``slot`` of per-layer stores ``[S, L, W]`` (``None`` entries skipped):
    [length, layers, W] on the host, in the stores' compact dtype; ``None`` when nothing is recorded."""
    layers = [t[slot, :length] for t in stores if t is not None]
    if not layers:
        return None
    return torch.stack(layers, dim=1).cpu()  # [length, layers, W]


@dataclasses.dataclass(frozen=True)
class TraceLayout:
    """Where a model's compact traces sit in SGLang's per-layer arrays: ``moe_layers`` the hidden-layer index of
    each main MoE layer (M of them, in order), ``full_index_layers`` that of each full-indexer layer (F),
    ``index_sources`` per hidden layer the full-indexer layer (0..F-1) whose keys it uses."""

    num_layers: int
    moe_layers: tuple[int, ...]
    full_index_layers: tuple[int, ...]
    index_sources: tuple[int, ...]

    @classmethod
    def of(cls, cfg) -> TraceLayout:
        """The layout of a ``GLM5Config`` (main layers only: SGLang captures no MTP layer)."""
        L = cfg.num_hidden_layers
        kinds = cfg.layer_indexer_types()
        full = tuple(i for i, kind in enumerate(kinds) if kind == "full")
        sources, seen = [], -1
        for kind in kinds:  # a shared layer reuses the last full layer before it (indexer_types[0] is full)
            seen += kind == "full"
            sources.append(max(seen, 0))
        return cls(L, tuple(i for i in range(L) if cfg.is_moe_layer(i)), full, tuple(sources))

    def wire(self, kind: str) -> tuple[int, tuple[int, ...]]:
        """(layers on the wire, the wire rows holding the compact trace's layers) of ``kind`` routing / index."""
        return self.num_layers, (self.moe_layers if kind == "routing" else self.full_index_layers)


def encode(trace: torch.Tensor, kind: str, layout: TraceLayout) -> str:
    """SGLang's wire form of a compact [P, M, K] routing / [P, F, Ki] index trace: base64 int32 [P, L, W]."""
    P, _, W = trace.shape
    if kind == "routing":
        full = torch.zeros(P, layout.num_layers, W, dtype=torch.int32)
        full[:, list(layout.moe_layers)] = trace.to(torch.int32)
    else:
        full = trace.to(torch.int32)[:, list(layout.index_sources)]
    data = full.contiguous().numpy().astype("<i4", copy=False).tobytes()
    return base64.b64encode(data).decode("ascii")


def decode(value: Any, where: str, *, rows: int) -> torch.Tensor:
    """The int32 [rows, layers * width] array of a wire trace (the receiver reshapes it with the model's layout,
    :func:`select`); ``ValueError`` naming ``where`` for anything else."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a base64 string (SGLang's int32 trace), got {type(value).__name__}")
    if rows < 1:
        raise ValueError(f"{where}: expected a trace of at least one position, got rows={rows}")
    max_chars = 4 * math.ceil(MAX_TRACE_BYTES / 3)
    if len(value) > max_chars or len(value) % 4:
        raise ValueError(f"{where}: expected the base64 of at most {MAX_TRACE_BYTES} bytes, got {len(value)} "
                         "characters")
    nbytes = len(value) // 4 * 3 - value[-2:].count("=")
    if nbytes == 0 or nbytes % (4 * rows):
        raise ValueError(f"{where}: expected {rows} positions of whole int32 rows, got {nbytes} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: expected base64, got invalid characters or padding") from None
    array = np.frombuffer(raw, dtype="<i4").reshape(rows, -1)
    return torch.from_numpy(array.astype(np.int32, copy=True))  # writable, native order


def select(trace: torch.Tensor, where: str, *, wire_layers: int, layers: tuple[int, ...], width: int
           ) -> torch.Tensor:
    """The compact [rows, len(layers), width] trace from a decoded wire trace [rows, wire_layers * width]."""
    if trace.dim() != 2 or trace.shape[1] != wire_layers * width:
        raise ValueError(f"{where}: expected {wire_layers} layers x {width} ids per position (the model's "
                         f"num_hidden_layers x width), got {tuple(trace.shape)}")
    return trace.reshape(trace.shape[0], wire_layers, width)[:, list(layers)]
