"""Argument validation shared by the public ops. Every failure is a ``ValueError`` or ``TypeError`` that
names the argument, what was expected and what came."""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

Dim = Union[int, str, None]  # int: exact size; str: a named size that must agree across arguments; None: any


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, value, *, dims: Sequence[Dim], dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
           sizes: Optional[Dict[str, int]] = None, legend: str = "") -> torch.Tensor:
    """Check that ``value`` is a tensor of rank ``len(dims)`` with an allowed dtype.

    Named dims (strings) are bound in ``sizes`` on first sight and must agree afterwards, so shape
    mismatches between arguments are reported against the argument that disagrees.
    """
    shape_text = legend or "[" + ", ".join("*" if d is None else str(d) for d in dims) + "]"
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {shape_text}, got {type(value).__name__}")
    if value.dim() != len(dims):
        raise ValueError(f"{name}: expected rank {len(dims)} {shape_text}, got shape {tuple(value.shape)}")
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
                    f"{name}: expected {shape_text} with {want}={sizes[want]} (from an earlier argument), "
                    f"got shape {tuple(value.shape)}"
                )
            sizes.setdefault(want, got)
        elif want != got:
            raise ValueError(f"{name}: expected {shape_text} with size {want} at dim {axis}, "
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
    :func:`skip_value_checks` and while torch.compile traces."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling():
        return False  # asked first: dynamo folds it, while ContextVar.get below would be a graph break
    return not (_SKIP_VALUE_CHECKS.get() or os.environ.get("GLM5_CHECK_VALUES", "1") == "0")


def finite(name: str, value: torch.Tensor) -> None:
    """Reject NaN / inf where they would silently corrupt a selection."""
    if not value_checks_enabled():
        return
    if not bool(torch.isfinite(value).all()):
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


def shape_of(sizes: Dict[str, int], *names: str) -> Tuple[int, ...]:
    return tuple(sizes[n] for n in names)
