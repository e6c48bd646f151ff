"""Argument validation shared by the public ops. Every failure is a ``ValueError`` or ``TypeError`` that
names the argument, what was expected and what came."""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Sequence
from typing import Optional, Union

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

Dim = Union[int, str, None]  # int: exact size; str: a named size that must agree across arguments; None: any


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def _shape_text(dims: Sequence[Dim], legend: str) -> str:
    """The expected shape as error messages show it (built only when a check fails: every op call checks)."""
    return legend or "[" + ", ".join("*" if d is None else str(d) for d in dims) + "]"


def tensor(name: str, value, *, dims: Sequence[Dim], dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
           sizes: Optional[dict[str, int]] = None, legend: str = "") -> torch.Tensor:
    """Check that ``value`` is a tensor of rank ``len(dims)`` with an allowed dtype.

    Named dims (strings) are bound in ``sizes`` on first sight and must agree afterwards, so shape
    mismatches between arguments are reported against the argument that disagrees.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {_shape_text(dims, legend)}, got {type(value).__name__}")
    if value.device.type == "meta":  # every op reads values (checks, selections, counts): none to read
        raise ValueError(f"{name}: expected a tensor with data, got one on the meta device "
                         "(to trace shapes, use FakeTensorMode or torch.compile)")
    if value.dim() != len(dims):
        raise ValueError(f"{name}: expected rank {len(dims)} {_shape_text(dims, legend)}, got shape "
                         f"{tuple(value.shape)}")
    if value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {value.dtype}")
    for axis, (want, got) in enumerate(zip(dims, value.shape)):
        if want is None:
            continue
        if isinstance(want, str):
            if sizes is None:
                raise AssertionError("named dims need a sizes dict")
            if want in sizes and sizes[want] != got:
                raise ValueError(
                    f"{name}: expected {_shape_text(dims, legend)} with {want}={sizes[want]} (from an earlier "
                    f"argument), got shape {tuple(value.shape)}"
                )
            sizes.setdefault(want, got)
        elif want != got:
            raise ValueError(f"{name}: expected {_shape_text(dims, legend)} with size {want} at dim {axis}, "
                             f"got shape {tuple(value.shape)}")
    return value


def same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"tensors must share one device, got {listing}")
    return next(iter(devices))


def same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    dtypes = {v.dtype for v in tensors.values()}
    if len(dtypes) > 1:
        listing = ", ".join(f"{k}: {v.dtype}" for k, v in tensors.items())
        raise TypeError(f"floating inputs must share one dtype, got {listing}")
    return next(iter(dtypes))


def positive_int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def positive_float(name: str, value, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (value >= 0.0 if allow_zero else value > 0.0) or value != value or value == float("inf"):
        raise ValueError(f"{name}: expected a finite float {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()


_LARGE_ALLOCATION_BYTES = 1 << 30  # below this, no buffer is worth a memory query


def _host_memory_bytes() -> Optional[int]:
    """Physical memory, capped by the process's address-space limit (``ulimit -v``); None if unknown."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else None


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """The most one buffer on ``device`` could ever get: host memory (capped by the address-space limit) for
    ``cpu``, the accelerator's total memory otherwise; None where unknown (then nothing is checked)."""
    if device.type == "cpu":
        return _host_memory_bytes()
    properties = getattr(getattr(torch, device.type, None), "get_device_properties", None)
    if properties is None:
        return None
    try:
        return int(properties(device).total_memory)
    except Exception:  # a vendor module without total_memory, or no such device: no bound
        return None


def allocation(name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, *, legend: str,
               hint: str = "") -> None:
    """A buffer whose size argument ``name`` chooses (an output width, a count table) must fit the device:
    a ValueError naming the argument, before anything is allocated, instead of an allocator error (or an
    abort, where the allocation would happen inside a native parallel region)."""
    if _compiling():  # shapes may be symbolic while tracing; the eager call checked them
        return
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _LARGE_ALLOCATION_BYTES:
        return
    limit = device_memory_bytes(device)
    if limit is not None and nbytes > limit:
        raise ValueError(f"{name}: {legend} {str(dtype).replace('torch.', '')} of shape {tuple(shape)} needs "
                         f"{nbytes / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB of {device.type} "
                         f"memory{hint}")


def topk_width(name: str, value, *, batch: int, queries: int, keys: int, device: torch.device) -> int:
    """An int >= 1. A width past the key count S is valid (the contract pads with -1: a fixed ``index_topk``
    meets short sequences), so what bounds it is the [B, T, topk] int32 output, which must fit the device.
    Kernels size their working sets by min(topk, S), never by topk."""
    positive_int(name, value)
    allocation(name, (batch, queries, value), torch.int32, device, legend="the output [B, T, topk]",
               hint=f" (S={keys} key slots: entries past {keys} would all be -1 padding)" if value > keys else "")
    return value


_SKIP_VALUE_CHECKS = contextvars.ContextVar("glm5_skip_value_checks", default=False)


@contextlib.contextmanager
def skip_value_checks():
    """Turn the value checks off in this thread / context only: for loops whose op inputs are built by
    trusted code (a rollout engine's decode step), where the checks are pure overhead."""
    token = _SKIP_VALUE_CHECKS.set(True)
    try:
        yield
    finally:
        _SKIP_VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    """Checks that read tensor values (NaN, index ranges) cost a device sync each. They are on by default,
    off under ``GLM5_CHECK_VALUES=0`` (for production loops on accelerators), inside
    :func:`skip_value_checks`, while torch.compile traces and under a FakeTensorMode (no values to read)."""
    if _compiling():
        return False  # asked first: dynamo folds it, while ContextVar.get below would be a graph break
    if _SKIP_VALUE_CHECKS.get() or os.environ.get("GLM5_CHECK_VALUES", "1") == "0":
        return False
    return not _tracing_fake()


_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


def _tracing_fake() -> bool:
    """Whether a FakeTensorMode is active (torch keeps at most one on its dispatch-mode stack)."""
    return torch._C._get_dispatch_mode(_FAKE_MODE_KEY) is not None


def finite(name: str, value: torch.Tensor) -> None:
    """Reject NaN / inf where they would silently corrupt a selection.

    Through the extremes (amin and amax propagate NaN; an inf is one of them): two reductions (plain amin / amax,
    which every backend has) and one host read, no bool tensor of the input's size (about 0.2x the time of
    isfinite().all() on a [8, 128, 4, 16] fp32 tensor on cpu)."""
    if not value_checks_enabled() or not value.is_floating_point() or not value.numel():
        return  # integers are always finite
    if value.requires_grad:  # a check, not part of the graph: amin / amax would save the input for backward
        value = value.detach()
    if not bool(torch.isfinite(torch.stack((value.amin(), value.amax()))).all()):
        raise ValueError(f"{name}: expected finite values, got NaN or inf")


def start_positions(start_pos, batch: int, num_queries: int, num_keys: int, device: torch.device,
                    *, name: str = "start_pos") -> Union[int, torch.Tensor]:
    """Validate the absolute position of the first query (int, or int tensor [B] for ragged batches).

    Query ``t`` of row ``b`` sits at position ``start_pos[b] + t`` and must have a key slot:
    ``0 <= start_pos[b]`` and ``start_pos[b] + T <= S``.
    """
    if isinstance(start_pos, torch.Tensor):
        tensor(name, start_pos, dims=(batch,), dtypes=INDEX_DTYPES, legend="[B] int")
        if start_pos.device != device:
            raise ValueError(f"{name}: expected device {device}, got {start_pos.device}")
        if not value_checks_enabled() or not start_pos.numel():  # an empty batch has nothing to check
            return start_pos
        lo, hi = int(start_pos.min()), int(start_pos.max())
    elif isinstance(start_pos, bool) or not isinstance(start_pos, int):
        raise TypeError(f"{name}: expected an int or an int tensor [B], got {type(start_pos).__name__}")
    else:
        lo = hi = start_pos
    if lo < 0 or hi + num_queries > num_keys:
        raise ValueError(
            f"{name}: expected 0 <= {name} and {name} + T <= S (T={num_queries} queries, S={num_keys} key slots), "
            f"got {name} in [{lo}, {hi}]"
        )
    return start_pos


def index_range(name: str, value: torch.Tensor, low: int, high: int) -> None:
    """Every entry of an index tensor in [low, high] (skipped when value checks are off)."""
    if not value_checks_enabled() or not value.numel():
        return
    lo, hi = int(value.min()), int(value.max())
    if lo < low or hi > high:
        raise ValueError(f"{name}: expected entries in [{low}, {high}], got range [{lo}, {hi}]")


def query_positions(start_pos: Union[int, torch.Tensor], batch: int, num_queries: int,
                    device: torch.device) -> torch.Tensor:
    """Absolute positions of the queries, int64 [B, T]."""
    offsets = torch.arange(num_queries, device=device)  # [T]
    if isinstance(start_pos, torch.Tensor):
        return start_pos.to(torch.int64).view(batch, 1) + offsets  # [B, T]
    return (offsets + start_pos).expand(batch, num_queries)  # [B, T]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """References compute in fp32, or in fp64 when given fp64 (so tests can build fp64 baselines)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the dispatch (~1 us) when ``t`` already has that dtype (``.to`` then returns ``t``
    itself): the hot paths of a decode step make ~190 such no-op casts."""
    return t if t.dtype == dtype else t.to(dtype)


def shape_of(sizes: dict[str, int], *names: str) -> tuple[int, ...]:
    return tuple(sizes[n] for n in names)
