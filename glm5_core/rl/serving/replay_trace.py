"""The replay traces a rollout engine returns: per position, the experts each MoE layer chose (routing replay)
and the keys each full-indexer layer selected (DSA index replay).

Legend: P positions of a finished request (prompt + completion - 1: every token but the last, which the engine
never ran), M main MoE layers, K experts per token, F full-indexer layers, Ki index_topk.

* Recorded in the engine's KV cache (``model.new_cache(record_routing=..., record_index_topk=...)``), so the
  prefix cache and the slot copies carry them with the KV: a finished request's trace covers its whole
  sequence, prefix-cache hits included, like SGLang's ``routed_experts`` (which slime replays).
* On the wire (``meta_info.routed_experts`` / ``meta_info.indexer_topk``): ``{"dtype", "shape", "data"}`` with
  ``data`` the base64 of the little-endian array [P, M, K] / [P, F, Ki] in the compact dtype (uint8 expert ids
  up to 256 experts, int16 key positions up to 32768 slots; see ``glm5_core.model.replay``). SGLang sends a
  bare base64 int32 string over all layers instead; this form says its own dtype and shape, so a client that
  does not know the model can still check it.
* :func:`decode` treats the payload as untrusted: dtype from a fixed list, shape checked against the expected
  rows and a byte cap, the base64 length checked before anything is decoded.
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Optional

import numpy as np
import torch

WIRE_DTYPES = {"uint8": "<u1", "int16": "<i2", "int32": "<i4"}
_TORCH_NAMES = {torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}
MAX_TRACE_BYTES = 256 * 2 ** 20  # one response's trace: far above any engine's max_len x layers x width


def read(stores, slot: int, length: int) -> Optional[torch.Tensor]:
    """Positions ``[0, length)`` of row ``slot`` of per-layer stores ``[S, L, W]`` (``None`` entries skipped):
    [length, layers, W] on the host, in the stores' compact dtype; ``None`` when nothing is recorded."""
    layers = [t[slot, :length] for t in stores if t is not None]
    if not layers:
        return None
    return torch.stack(layers, dim=1).cpu()  # [length, layers, W]


def encode(trace: torch.Tensor) -> dict[str, Any]:
    """The wire form of a [P, layers, W] trace."""
    name = _TORCH_NAMES.get(trace.dtype)
    if name is None:
        raise ValueError(f"trace: expected one of {sorted(WIRE_DTYPES)}, got {trace.dtype}")
    data = trace.contiguous().numpy().astype(WIRE_DTYPES[name], copy=False).tobytes()
    return {"dtype": name, "shape": list(trace.shape), "data": base64.b64encode(data).decode("ascii")}


def decode(value: Any, where: str, *, rows: int) -> torch.Tensor:
    """The [rows, layers, W] int tensor of a wire trace; ``ValueError`` naming ``where`` for anything else."""
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise ValueError(f"{where}: expected an object with dtype, shape and data, got {str(value)[:80]!r}")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"{where}.dtype: expected one of {sorted(WIRE_DTYPES)}, got {str(dtype)[:40]!r}")
    if not (isinstance(shape, list) and len(shape) == 3
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)):
        raise ValueError(f"{where}.shape: expected three ints >= 1 [positions, layers, width], got {str(shape)[:80]}")
    if shape[0] != rows:
        raise ValueError(f"{where}.shape: expected {rows} positions (prompt + completion - 1), got {shape[0]}")
    nbytes = math.prod(shape) * np.dtype(WIRE_DTYPES[dtype]).itemsize
    if nbytes > MAX_TRACE_BYTES:
        raise ValueError(f"{where}.shape: expected at most {MAX_TRACE_BYTES} bytes, got {shape} ({nbytes} bytes)")
    if not isinstance(data, str) or len(data) != 4 * math.ceil(nbytes / 3):
        raise ValueError(f"{where}.data: expected the base64 of {nbytes} bytes, got "
                         f"{len(data) if isinstance(data, str) else type(data).__name__} characters")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}.data: expected base64, got invalid characters or padding") from None
    if len(raw) != nbytes:
        raise ValueError(f"{where}.data: expected {nbytes} bytes, got {len(raw)}")
    array = np.frombuffer(raw, dtype=WIRE_DTYPES[dtype]).reshape(shape)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))  # writable, native order
