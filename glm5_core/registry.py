"""Backend registry: which kernel runs each op, and why.

Resolution of the backend for a call:

1. the explicit ``backend=`` argument of the op;
2. the innermost ``use_backend(...)`` context, else the ``GLM5_BACKEND`` environment variable;
3. auto-detection: of every discovered backend (built-in and out-of-tree alike) whose ``detect()`` says its
   hardware is here, the one with the highest ``priority`` whose probe passes; ``cpu`` detects always and has
   the lowest priority.

``"auto"`` anywhere means "go on to the next rule". An explicitly requested backend that is not
available raises :class:`BackendUnavailableError` with the reason; it never falls back silently.
An op the chosen backend does not implement (or a call it declines through its kernel's
``supports(...)`` hook) runs the pure-torch reference, which is the spec; ``explain()`` shows which
implementation each op resolves to and why. ``GLM5_STRICT=1`` turns every such fallback into a
:class:`BackendCoverageError`, for vendors proving coverage.

Backends are discovered from the vendor folders of ``glm5_core/backends/`` (each with a ``backend.py``
declaring ``BACKEND``: so a source tree works without being installed) and through the entry-point group
``glm5_core.backends``, the group an out-of-tree vendor package uses. Discovery, availability probes and
kernel tables are computed lazily, once; :func:`reset` forgets them (tests, plug-ins installed at run time).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import os
import pkgutil
from importlib import metadata
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

ENTRY_POINT_GROUP = "glm5_core.backends"
BUILTIN_PACKAGE = "glm5_core.backends"  # in-tree vendors: <package>.<vendor>.backend:BACKEND

# Every dispatchable op, with the dotted path of its reference implementation (the spec).
REFERENCES: Mapping[str, str] = {
    "mla_prefill": "glm5_core.ops.mla:prefill_reference",
    "mla_decode": "glm5_core.ops.mla:decode_reference",
    "dsa_indexer_scores": "glm5_core.ops.dsa:indexer_scores_reference",
    "dsa_indexer_topk": "glm5_core.ops.dsa:indexer_topk_reference",
    "dsa_sparse_prefill": "glm5_core.ops.dsa:sparse_attention_reference",
    "dsa_sparse_decode": "glm5_core.ops.dsa:sparse_attention_reference",
    "moe_route": "glm5_core.ops.moe:route_reference",
    "moe_dispatch": "glm5_core.ops.moe:dispatch_reference",
    "moe_combine": "glm5_core.ops.moe:combine_reference",
    "moe_experts": "glm5_core.ops.moe:grouped_swiglu_reference",
    "moe_fused_experts": "glm5_core.ops.moe:fused_experts_reference",
    "muon_orthogonalize": "glm5_core.ops.muon:orthogonalize_reference",
}
OP_NAMES: Tuple[str, ...] = tuple(REFERENCES)

# Composite ops (as torch's CompositeImplicitAutograd): a backend may register a fused kernel; one that
# does not runs the composite, which calls the backend's kernels for the parts (never the whole reference).
# Value: "module:function" taking the op's arguments plus ``backend=``; it is differentiable when the parts
# are (each part falls back on its own).
COMPOSITES: Mapping[str, str] = {
    "moe_fused_experts": "glm5_core.ops.moe:fused_experts_composite",
}
COMPOSITE_PARTS: Mapping[str, Tuple[str, ...]] = {
    "moe_fused_experts": ("moe_dispatch", "moe_experts", "moe_combine"),
}

_ACTIVE_BACKEND: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("glm5_backend", default=None)
# (op, why) of each call a backend kernel declined inside ``record_fallbacks()``; None when nobody records.
_DECLINED_LOG: contextvars.ContextVar[Optional[List[Tuple[str, str]]]] = contextvars.ContextVar(
    "glm5_declined_log", default=None)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why."""


class BackendCoverageError(RuntimeError):
    """``GLM5_STRICT=1`` and an op would have fallen back to the reference."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a backend declares. Out-of-tree vendors build one of these and expose it through the
    ``glm5_core.backends`` entry point.

    ``probe`` returns ``(available, reason)`` and must be cheap to call repeatedly (cache it).
    ``kernel_table`` is called only once the backend is available; it imports the kernel modules and
    returns ``{op_name: callable}``. A callable may carry a ``supports(*args, **kwargs) -> (bool, why)``
    attribute to decline calls outside its capabilities (they then run the reference). A kernel is taken
    to have no backward unless it sets ``differentiable = True``: calls that need gradients run the
    (differentiable) reference instead of silently dropping them.
    ``missing`` gives, per op, why the backend does not implement it (shown by ``explain``).
    ``runtime_device`` is the torch device type tensors must live on (``cpu`` for Triton's interpreter).
    ``details`` adds a status line to ``glm5 backends`` (called after the kernel table is loaded).
    ``detect`` says, cheaply and without side effects beyond a cached probe, whether this backend's hardware
    is here; auto-detection takes, among the backends that detect, the highest ``priority`` whose ``probe``
    passes (ties by name). The default never detects: such a backend runs only when asked for by name.
    """

    name: str
    device_type: str
    dist_backend: str
    probe: Callable[[], Tuple[bool, str]]
    kernel_table: Callable[[], Mapping[str, Callable]]
    missing: Mapping[str, str] = dataclasses.field(default_factory=dict)
    runtime_device: Optional[Callable[[], str]] = None
    description: str = ""
    details: Optional[Callable[[], str]] = None  # extra status once the kernel table is loaded (e.g. build state)
    detect: Callable[[], bool] = lambda: False
    priority: int = 0

    def available(self) -> Tuple[bool, str]:
        return self.probe()

    def device(self) -> str:
        return self.runtime_device() if self.runtime_device is not None else self.device_type


@dataclasses.dataclass(frozen=True)
class Resolution:
    """How one op resolves on one backend."""

    op: str
    backend: str
    impl: Callable
    label: str  # "cuda: glm5_core.backends.cuda.dsa_topk.indexer_topk" or "reference"
    reason: str  # why this implementation (empty when the backend's own kernel runs)

    @property
    def is_reference(self) -> bool:
        return self.label == "reference"


def strict_mode() -> bool:
    return os.environ.get("GLM5_STRICT", "0") not in ("", "0")


def _import_target(target: str) -> Callable:
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def reference(op: str) -> Callable:
    """The reference implementation (the spec) of ``op``."""
    if op not in REFERENCES:
        raise ValueError(f"op: expected one of {', '.join(OP_NAMES)}, got {op!r}")
    return _import_target(REFERENCES[op])


def builtin_backend_names() -> Tuple[str, ...]:
    """The vendor folders of ``glm5_core/backends/`` that declare a backend (``backend.py``), sorted."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    return tuple(sorted(info.name for info in pkgutil.iter_modules(package.__path__)
                        if info.ispkg and importlib.util.find_spec(f"{BUILTIN_PACKAGE}.{info.name}.backend")))


def _entry_points():
    try:
        return metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # Python < 3.10
        return metadata.entry_points().get(ENTRY_POINT_GROUP, [])


@functools.lru_cache(maxsize=1)
def _discover() -> Dict[str, Backend]:
    found: Dict[str, Backend] = {}
    for name in builtin_backend_names():
        found[name] = _import_target(f"{BUILTIN_PACKAGE}.{name}.backend:BACKEND")
    for ep in _entry_points():
        if ep.name in found or ep.value.startswith(f"{BUILTIN_PACKAGE}."):
            continue  # the built-in vendors' own entry points, or a plugin reusing a built-in name
        try:
            backend = ep.load()
        except Exception as exc:  # a broken third-party plugin must not break the others
            backend = _broken_backend(ep.name, f"entry point {ep.value!r} failed to load: {exc!r}")
        if not isinstance(backend, Backend):
            backend = _broken_backend(ep.name, f"entry point {ep.value!r} is not a glm5_core.registry.Backend")
        if backend.name in found:
            continue  # a plugin cannot replace a backend that is already known (its name is taken)
        found[backend.name] = backend
    return found


def _broken_backend(name: str, reason: str) -> Backend:
    return Backend(name=name, device_type="?", dist_backend="?", probe=lambda: (False, reason), kernel_table=dict)


def backends() -> Dict[str, Backend]:
    """All known backends by name: built-in ones by priority (cpu first), then third-party ones by name."""
    found = _discover()
    builtin = set(builtin_backend_names())
    order = sorted((n for n in found if n in builtin), key=lambda n: (found[n].priority, n))
    order += sorted(n for n in found if n not in builtin)
    return {n: found[n] for n in order}


def reset() -> None:
    """Forget discovered backends, kernel tables and resolved references (for tests, and for a process that
    installed a plug-in after its first op call). Availability probes cached by the backends themselves stay."""
    _discover.cache_clear()
    _kernel_table.cache_clear()
    reference.cache_clear()


def get_backend(name: str) -> Backend:
    known = backends()
    if name not in known:
        raise ValueError(f"backend: expected 'auto' or one of {', '.join(known)}, got {name!r}")
    return known[name]


@functools.lru_cache(maxsize=None)
def _kernel_table(name: str) -> Mapping[str, Callable]:
    table = dict(get_backend(name).kernel_table())
    unknown = sorted(set(table) - set(OP_NAMES))
    if unknown:
        raise ValueError(f"backend {name!r} registers unknown ops {unknown}; known ops: {', '.join(OP_NAMES)}")
    return table


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[str]:
    """Run the enclosed ops on backend ``name`` (``None`` or ``"auto"``: auto-detect).

    Fails at once if the backend is unavailable."""
    resolved = require_available(resolve_backend_name(name)).name
    token = _ACTIVE_BACKEND.set(resolved)
    try:
        yield resolved
    finally:
        _ACTIVE_BACKEND.reset(token)


def resolve_backend_name(backend: Optional[str] = None) -> str:
    """Apply the resolution order (argument > context / ``GLM5_BACKEND`` > hardware)."""
    sources = (("backend", backend), ("backend", _ACTIVE_BACKEND.get()),
               ("GLM5_BACKEND", os.environ.get("GLM5_BACKEND")))
    for source, candidate in sources:
        if candidate not in (None, "", "auto"):
            if not isinstance(candidate, str):
                raise TypeError(f"{source}: expected a str, got {type(candidate).__name__}")
            if candidate not in backends():
                raise ValueError(f"{source}: expected 'auto' or one of {', '.join(backends())}, got {candidate!r}")
            return candidate
    return _auto_backend()


def _auto_backend() -> str:
    """Among the backends whose ``detect()`` sees their hardware, the highest-priority one whose probe passes
    (a GPU without triton falls through to the next, finally ``cpu``)."""
    detected = [b for b in backends().values() if _detects(b)]
    for backend in sorted(detected, key=lambda b: (-b.priority, b.name)):
        if backend.available()[0]:
            return backend.name
    return "cpu"


def _detects(backend: Backend) -> bool:
    try:
        return bool(backend.detect())
    except Exception:  # a broken third-party detect() must not break auto-detection for the others
        return False


def require_available(name: str) -> Backend:
    backend = get_backend(name)
    ok, reason = backend.available()
    if not ok:
        raise BackendUnavailableError(f"{name}: {reason}")
    return backend


def _label(name: str, fn: Callable) -> str:
    return f"{name}: {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _composite(op: str, backend: str) -> Callable:
    target = _import_target(COMPOSITES[op])

    def composite(*args, **kwargs):
        return target(*args, backend=backend, **kwargs)

    composite.differentiable = True
    composite.__module__, composite.__qualname__ = target.__module__, target.__qualname__
    return composite


def _own_or_composite(op: str, name: str, table: Mapping[str, Callable]) -> Optional[Resolution]:
    if op in table:
        return Resolution(op, name, table[op], _label(name, table[op]), "")
    if op in COMPOSITES:
        impl = _composite(op, name)
        return Resolution(op, name, impl, _label(name, impl),
                          f"{name} has no fused kernel: its own kernels for the parts")
    return None


def resolve(op: str, backend: Optional[str] = None) -> Resolution:
    """Which implementation runs ``op`` on ``backend`` (after the resolution order)."""
    ref = reference(op)
    name = resolve_backend_name(backend)
    be = require_available(name)
    own = _own_or_composite(op, name, _kernel_table(name))
    if own is not None:
        return own
    reason = be.missing.get(op, f"{name} does not implement {op}")
    if strict_mode():
        raise BackendCoverageError(f"{op}: {reason}, and GLM5_STRICT=1 forbids the reference fallback")
    return Resolution(op, name, ref, "reference", reason)


def needs_grad(*args, **kwargs) -> bool:
    """Autograd is recording and some tensor argument requires a gradient."""
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in itertools.chain(args, kwargs.values()))


def _declined(impl: Callable, args, kwargs) -> str:
    """Why a backend kernel cannot take this call ('' when it can)."""
    if not getattr(impl, "differentiable", False) and needs_grad(*args, **kwargs):
        return "the kernel has no backward and this call needs gradients"
    supports = getattr(impl, "supports", None)
    if supports is not None:
        ok, why = supports(*args, **kwargs)
        if not ok:
            return why
    return ""


@contextlib.contextmanager
def record_fallbacks() -> Iterator[List[Tuple[str, str]]]:
    """Collect ``(op, why)`` for every call in the block that a backend kernel declined (its ``supports`` hook,
    or gradients it cannot give), so that the reference ran instead. Static fallbacks (ops a backend does not
    implement) are not calls a kernel declined: :func:`runs_reference` answers for those."""
    declined: List[Tuple[str, str]] = []
    token = _DECLINED_LOG.set(declined)
    try:
        yield declined
    finally:
        _DECLINED_LOG.reset(token)


def call(op: str, *args, backend: Optional[str] = None, **kwargs):
    """Dispatch ``op`` to the resolved implementation. Arguments are already validated by ``glm5_core.ops``."""
    res = resolve(op, backend)
    impl = res.impl
    if not res.is_reference:
        why = _declined(impl, args, kwargs)
        if why and op in COMPOSITES:  # a declining fused kernel (a composite never declines): the backend's parts
            impl = _composite(op, res.backend)
        elif why:
            if strict_mode():
                raise BackendCoverageError(
                    f"{op}: {res.backend} declines this call ({why}), and GLM5_STRICT=1 forbids the reference fallback"
                )
            declined = _DECLINED_LOG.get()
            if declined is not None:
                declined.append((op, why))
            impl = reference(op)
    return impl(*args, **kwargs)


def explain(backend: Optional[str] = None, *, require: bool = True) -> List[Resolution]:
    """One :class:`Resolution` per op for ``backend`` (strict mode is not applied here).

    With ``require=False`` an unavailable backend is explained too (what its kernel table declares),
    so users can see what a vendor backend would run before they have the hardware."""
    name = resolve_backend_name(backend)
    be = require_available(name) if require else get_backend(name)
    table = _kernel_table(name)
    rows = []
    for op in OP_NAMES:
        own = _own_or_composite(op, name, table)
        if own is not None:
            rows.append(own)
        else:
            rows.append(Resolution(op, name, reference(op), "reference",
                                   be.missing.get(op, f"{name} does not implement {op}")))
    return rows


def runs_reference(op: str, backend: Optional[str] = None) -> bool:
    """``op`` computes with the reference on ``backend``: no kernel of its own, or (a composite without a
    fused kernel) every part falls back."""
    res = resolve(op, backend)
    if op in COMPOSITE_PARTS and not res.is_reference and op not in _kernel_table(res.backend):
        return all(runs_reference(part, backend) for part in COMPOSITE_PARTS[op])
    return res.is_reference


def missing_ops(backend: str) -> List[str]:
    """Ops that ``backend`` leaves to the reference."""
    return [op for op in OP_NAMES if runs_reference(op, backend)]
