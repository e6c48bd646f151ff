"""Peak bytes allocated while a function runs on CPU: torch storages + numpy buffers.

Method:
* torch: a ``TorchDispatchMode`` sees every aten op (factories, matmuls, sorts ...). Each output whose
  storage is new is counted at its storage size until that storage is freed: CPU storages keep one
  Python object for their lifetime, so a ``weakref.finalize`` on it fires exactly when the memory goes
  (views keep it alive). The running sum's maximum is the torch peak.
* numpy: Triton's interpreter executes kernels with numpy; numpy reports its buffers to ``tracemalloc``,
  whose peak (minus the level at entry) bounds the interpreter's temporaries (it also counts Python
  objects, which only makes the bound looser).
Inputs that exist before the call are not counted: this is the *extra* memory of the call.
"""
from __future__ import annotations

import dataclasses
import tracemalloc
import weakref

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_ptr(value):
    if isinstance(value, torch.Tensor):
        return value.untyped_storage().data_ptr()
    if isinstance(value, torch.UntypedStorage):
        return value.data_ptr()
    return None


class _StorageMeter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive = set()

    def _released(self, key, nbytes):
        self._alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_ptr(a) for a in _pytree.tree_leaves((args, kwargs))}  # outputs aliasing these are views
        for t in _pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            nbytes = storage.nbytes()
            if nbytes == 0 or key in self._alive or key in inputs:
                continue
            self._alive.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._released, key, nbytes)
        return out


@dataclasses.dataclass
class Peak:
    torch_bytes: int
    numpy_bytes: int


def measure(fn, *args, **kwargs):
    """(result, Peak) of ``fn(*args, **kwargs)``."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    meter = _StorageMeter()
    with meter:
        result = fn(*args, **kwargs)
    _, peak = tracemalloc.get_traced_memory()
    if not was_tracing:
        tracemalloc.stop()
    return result, Peak(torch_bytes=meter.peak, numpy_bytes=peak - base)
