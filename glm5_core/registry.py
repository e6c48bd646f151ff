"""Backend registry: which kernel runs each op, and why.

Ops are declared once, next to their references: each family module of ``glm5_core.ops`` ends with a tuple
``OPS`` of :class:`~glm5_core.opspec.OpSpec` (name, reference, conformance family, whether training needs its
gradient, composite parts); ``OP_NAMES``, ``REFERENCES``, ``COMPOSITES`` and ``COMPOSITE_PARTS`` are derived
from them. A backend's kernel table maps op names to :class:`~glm5_core.kernel.Kernel` records.

Resolution of the backend for a call:

1. the explicit ``backend=`` argument of the op (a name, or a :class:`Binding` made by :func:`bind`);
2. the innermost ``use_backend(...)`` context, else the ``GLM5_BACKEND`` environment variable;
3. auto-detection: of every discovered backend (built-in and out-of-tree alike) whose ``detect()`` says its
   hardware is here, the one with the highest ``priority`` whose probe passes; ``cpu`` detects always and has
   the lowest priority.

``"auto"`` anywhere means "go on to the next rule". An explicitly requested backend that is not
available raises :class:`BackendUnavailableError` with the reason; it never falls back silently.
An op the chosen backend does not implement (or a call it declines through its kernel's
``supports(...)`` hook, or a call needing gradients its kernel cannot give) runs the pure-torch reference,
which is the spec; ``explain()`` shows which implementation each op resolves to and why. ``GLM5_STRICT=1``
turns every such fallback into a :class:`BackendCoverageError`, for vendors proving coverage.
``record_reference_runs()`` lists the calls that computed with the reference in a block (each training step
reports them as ``reference_ops``). An op whose outputs carry no gradient (``OpSpec.gradient_free``: the
top-k indices) keeps its kernel when inputs require grad.

Binding (vLLM's ``CustomOp`` dispatch-at-construction): model layers and optimizers call :func:`bind` once,
when they are built, applying the resolution order at that moment, and pass the :class:`Binding` as
``backend=`` to the ops; such a call pays only its kernel's ``supports`` check and the gradient routing,
reads no environment variable and is traceable by ``torch.compile``. A call without a binding reads the
``use_backend`` context and ``GLM5_BACKEND`` (so both keep working), then finds its resolution in a cache
per (op, backend name).

Backends are discovered from the vendor folders of ``glm5_core/backends/`` (each with a ``backend.py``
declaring ``BACKEND``: so a source tree works without being installed) and through the entry-point group
``glm5_core.backends``, the group an out-of-tree vendor package uses. Op declarations, discovery, availability
probes, kernel tables and resolutions are computed lazily, once; :func:`reset` forgets them (tests, plug-ins
installed at run time). Bindings made before a reset keep what they resolved.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import os
import pkgutil
import types
from collections.abc import Iterator, Mapping
from importlib import metadata
from typing import Callable, Optional, Union

import torch

from glm5_core.device_facts import DeviceFacts as DeviceFacts  # re-exported: vendors declare their devices
from glm5_core.kernel import Kernel as Kernel  # re-exported: vendors build their tables from it
from glm5_core.kernel import needs_grad as needs_grad
from glm5_core.opspec import OpSpec as OpSpec
from glm5_core.opspec import target_of

ENTRY_POINT_GROUP = "glm5_core.backends"
BUILTIN_PACKAGE = "glm5_core.backends"  # in-tree vendors: <package>.<vendor>.backend:BACKEND
OPS_PACKAGE = "glm5_core.ops"  # its FAMILY_MODULES declare the ops, each in a tuple OPS

_ACTIVE_BACKEND: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("glm5_backend", default=None)
# (op, why) of each call a backend kernel declined inside ``record_fallbacks()``; None when nobody records.
_DECLINED_LOG: contextvars.ContextVar[Optional[list[tuple[str, str]]]] = contextvars.ContextVar(
    "glm5_declined_log", default=None)
# (op, why) of each call that computed with the reference inside ``record_reference_runs()`` (declined calls and
# ops without a kernel alike); None when nobody records.
_REFERENCE_LOG: contextvars.ContextVar[Optional[list[tuple[str, str]]]] = contextvars.ContextVar(
    "glm5_reference_log", default=None)


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
    returns ``{op_name: Kernel(fn, supports=None, differentiable=False)}``. ``supports(*args, **kwargs) ->
    (ok, why)`` declines calls outside the kernel's capabilities (they then run the reference); calls that
    need gradients run the (differentiable) reference unless the kernel is ``differentiable`` (its
    ``supports`` is then never asked about them). For compatibility a table entry may also be a bare
    callable, as out-of-tree tables were written before :class:`Kernel`: it is wrapped, its ``supports`` and
    ``differentiable`` function attributes read once, when the table is loaded.
    ``facts`` are the vendor's :class:`~glm5_core.device_facts.DeviceFacts` (device type, distributed backend,
    visible-devices variable, Ray resource, dtypes, device count); ``device_type`` and ``dist_backend`` are read
    from them (a backend declared with those two fields alone gets facts made of them: a host-like device).
    ``missing`` gives, per op, why the backend does not implement it (shown by ``explain``); an op it neither
    implements nor names there gets :func:`default_missing_reason`, so a new op needs no edit of a vendor
    without a kernel for it.
    ``runtime_device`` is the torch device type tensors must live on (``cpu`` for Triton's interpreter).
    ``details`` adds a status line to ``glm5 backends`` (called after the kernel table is loaded).
    ``detect`` says, cheaply and without side effects beyond a cached probe, whether this backend's hardware
    is here; auto-detection takes, among the backends that detect, the highest ``priority`` whose ``probe``
    passes (ties by name). The default never detects: such a backend runs only when asked for by name.
    """

    name: str
    device_type: Optional[str] = None  # derived from ``facts`` when not given
    dist_backend: Optional[str] = None  # derived from ``facts`` when not given
    probe: Callable[[], tuple[bool, str]] = dataclasses.field(kw_only=True)
    kernel_table: Callable[[], Mapping[str, Union[Kernel, Callable]]] = dataclasses.field(kw_only=True)
    missing: Mapping[str, str] = dataclasses.field(default_factory=dict)
    runtime_device: Optional[Callable[[], str]] = None
    description: str = ""
    details: Optional[Callable[[], str]] = None  # extra status once the kernel table is loaded (e.g. build state)
    detect: Callable[[], bool] = lambda: False
    priority: int = 0
    facts: Optional[DeviceFacts] = None  # the vendor's device facts (built from the two fields above when None)

    def __post_init__(self) -> None:
        if self.facts is None:
            if not self.device_type or not self.dist_backend:
                raise TypeError(f"Backend {self.name!r}: expected facts= (a DeviceFacts) or device_type= and "
                                f"dist_backend=, got device_type={self.device_type!r}, "
                                f"dist_backend={self.dist_backend!r}")
            object.__setattr__(self, "facts", DeviceFacts(self.device_type, self.dist_backend))
            return
        for field_name in ("device_type", "dist_backend"):
            given, declared = getattr(self, field_name), getattr(self.facts, field_name)
            if given is not None and given != declared:
                raise ValueError(f"Backend {self.name!r}: {field_name}: expected {declared!r} (its facts), "
                                 f"got {given!r}")
            object.__setattr__(self, field_name, declared)

    def available(self) -> tuple[bool, str]:
        return self.probe()

    def device(self) -> str:
        return self.runtime_device() if self.runtime_device is not None else self.device_type


@dataclasses.dataclass(frozen=True)
class Resolution:
    """How one op resolves on one backend."""

    op: str
    backend: str
    impl: Callable  # what runs: the backend's Kernel, the composite of its kernels for the parts, or the reference
    label: str  # "<backend>: glm5_core.backends.triton.indexer.indexer_topk" or "reference"
    reason: str  # why this implementation (when the backend's own kernel runs: its note, usually empty)
    spec: Optional[OpSpec] = None
    kernel: Optional[Kernel] = None  # the backend's own kernel (None: the composite or the reference runs)

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


# --------------------------------------------------------------------------------------------- op declarations
@functools.lru_cache(maxsize=1)
def op_specs() -> Mapping[str, OpSpec]:
    """Every dispatchable op by name, in declaration order: the ``OPS`` tuples of ``glm5_core.ops``'s
    ``FAMILY_MODULES``."""
    specs: dict[str, OpSpec] = {}
    for module in importlib.import_module(OPS_PACKAGE).FAMILY_MODULES:
        for spec in module.OPS:
            if not isinstance(spec, OpSpec):
                raise TypeError(f"{module.__name__}.OPS: expected OpSpec entries, got {type(spec).__name__}")
            if spec.name in specs:
                raise ValueError(f"{module.__name__}.OPS: op {spec.name!r} is declared twice")
            specs[spec.name] = spec
    for spec in specs.values():
        unknown = [part for part in spec.parts if part not in specs]
        if unknown:
            raise ValueError(f"{spec.name}: parts: expected declared ops, got unknown {unknown}")
    return types.MappingProxyType(specs)


def op_spec(op: str) -> OpSpec:
    """The declaration of ``op``."""
    specs = op_specs()
    if op not in specs:
        raise ValueError(f"op: expected one of {', '.join(specs)}, got {op!r}")
    return specs[op]


def reference(op: str) -> Callable:
    """The reference implementation (the spec) of ``op``."""
    return op_spec(op).reference


# Tables of the registry's earlier interface, derived from the declarations when read (module __getattr__).
_DERIVED_TABLES: Mapping[str, Callable[[Mapping[str, OpSpec]], object]] = {
    "OP_NAMES": lambda specs: tuple(specs),
    "REFERENCES": lambda specs: types.MappingProxyType({n: target_of(s.reference) for n, s in specs.items()}),
    "COMPOSITES": lambda specs: types.MappingProxyType(
        {n: target_of(s.composite) for n, s in specs.items() if s.is_composite}),
    "COMPOSITE_PARTS": lambda specs: types.MappingProxyType(
        {n: s.parts for n, s in specs.items() if s.is_composite}),
}


def __getattr__(name: str):
    if name in _DERIVED_TABLES:
        return _DERIVED_TABLES[name](op_specs())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------- backends
@functools.lru_cache(maxsize=1)
def builtin_backend_names() -> tuple[str, ...]:
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
def _discover() -> dict[str, Backend]:
    found: dict[str, Backend] = {}
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


def backends() -> dict[str, Backend]:
    """All known backends by name: built-in ones by priority (cpu first), then third-party ones by name."""
    found = _discover()
    builtin = set(builtin_backend_names())
    order = sorted((n for n in found if n in builtin), key=lambda n: (found[n].priority, n))
    order += sorted(n for n in found if n not in builtin)
    return {n: found[n] for n in order}


def reset() -> None:
    """Forget discovered backends, kernel tables, resolutions and op declarations (for tests, and for a process
    that installed a plug-in after its first op call). Availability probes cached by the backends themselves
    stay, and so do bindings already made (they hold what they resolved)."""
    _discover.cache_clear()
    builtin_backend_names.cache_clear()
    _kernel_table.cache_clear()
    _resolution.cache_clear()
    op_specs.cache_clear()


def get_backend(name: str) -> Backend:
    known = backends()
    if name not in known:
        raise ValueError(_unknown_backend("backend", name, known))
    return known[name]


def _unknown_backend(source: str, name: object, known: Mapping[str, Backend]) -> str:
    close = difflib.get_close_matches(str(name).lower(), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{source}: expected 'auto' or one of {', '.join(known)}, got {name!r}{hint}"


@functools.cache
def _kernel_table(name: str) -> Mapping[str, Kernel]:
    table = {op: Kernel.of(entry) for op, entry in get_backend(name).kernel_table().items()}
    known = op_specs()
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"backend {name!r} registers unknown ops {unknown}; known ops: {', '.join(known)}")
    return types.MappingProxyType(table)


# --------------------------------------------------------------------------------------------- resolution
@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[str]:
    """Run the enclosed ops on backend ``name`` (``None`` or ``"auto"``: auto-detect).

    Fails at once if the backend is unavailable. Layers built inside the block bind this backend (see
    :func:`bind`); layers built earlier keep the backend they bound."""
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
                raise ValueError(_unknown_backend(source, candidate, backends()))
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


def default_missing_reason(spec: OpSpec, backend: str) -> str:
    """Why ``backend`` runs the reference for ``spec``, for an op its ``missing`` does not name."""
    return (f"{backend} has no kernel for {spec.name} ({spec.family} family): the reference "
            f"{target_of(spec.reference)} runs")


def _resolve_in(spec: OpSpec, name: str, backend: Backend, table: Mapping[str, Kernel]) -> Resolution:
    """``spec`` on backend ``name``: its own kernel, else (a composite op) the composite of its parts, else the
    reference with the backend's reason."""
    kernel = table.get(spec.name)
    if kernel is not None:
        return Resolution(spec.name, name, kernel, f"{name}: {kernel.name}", kernel.note, spec=spec, kernel=kernel)
    if spec.is_composite:
        return Resolution(spec.name, name, functools.partial(spec.composite, backend=name),
                          f"{name}: {spec.composite.__module__}.{spec.composite.__qualname__}",
                          f"{name} has no fused kernel: its own kernels for the parts", spec=spec)
    reason = backend.missing.get(spec.name) or default_missing_reason(spec, name)
    return Resolution(spec.name, name, spec.reference, "reference", reason, spec=spec)


@functools.cache
def _resolution(op: str, name: str) -> Resolution:
    """The resolution of ``op`` on the backend named ``name`` (an explicit name: unknown or unavailable raise)."""
    spec = op_spec(op)
    backend = require_available(name)
    return _resolve_in(spec, name, backend, _kernel_table(name))


def _strict_fallback_error(res: Resolution) -> BackendCoverageError:
    return BackendCoverageError(f"{res.op}: {res.reason}, and GLM5_STRICT=1 forbids the reference fallback")


def resolve(op: str, backend: BackendArg = None) -> Resolution:
    """Which implementation runs ``op`` on ``backend`` (after the resolution order)."""
    res = _lookup(op, backend)
    if res.is_reference and strict_mode():
        raise _strict_fallback_error(res)
    return res


# --------------------------------------------------------------------------------------------- binding
@dataclasses.dataclass(frozen=True, eq=False)
class Binding:
    """Every op resolved once on one backend: what :func:`bind` returns, what a layer or optimizer holds and
    passes as ``backend=`` to the ops. Immutable: copies share it; pickling rebinds by backend name."""

    backend: str
    resolutions: Mapping[str, Resolution]

    def resolution(self, op: str) -> Resolution:
        res = self.resolutions.get(op)
        if res is None:
            raise ValueError(f"op: expected one of {', '.join(self.resolutions)}, got {op!r}")
        return res

    def __repr__(self) -> str:
        return f"Binding({self.backend!r})"

    def __copy__(self) -> Binding:
        return self

    def __deepcopy__(self, memo) -> Binding:
        return self

    def __reduce__(self):
        return bind, (self.backend,)


BackendArg = Union[str, None, Binding]  # what ``backend=`` takes: a name, None / "auto", or a Binding


def bind(backend: BackendArg = None) -> Binding:
    """Resolve every op on ``backend`` now: explicit name > ``use_backend`` context / ``GLM5_BACKEND`` >
    auto-detection, as they stand at this call (a :class:`Binding` is returned as it is). An unavailable
    backend raises :class:`BackendUnavailableError` here, when the layer is built. Strict mode is applied
    when a call falls back, not here: a layer may hold ops it never calls."""
    if isinstance(backend, Binding):
        return backend
    name = require_available(resolve_backend_name(backend)).name
    return Binding(name, types.MappingProxyType({op: _resolution(op, name) for op in op_specs()}))


def _lookup(op: str, backend: BackendArg) -> Resolution:
    if isinstance(backend, Binding):
        return backend.resolution(op)
    if backend in (None, "", "auto"):
        return _resolution(op, resolve_backend_name())  # the use_backend context, GLM5_BACKEND, the hardware
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name, a registry.Binding or None, got {type(backend).__name__}")
    return _resolution(op, backend)


# --------------------------------------------------------------------------------------------- dispatch
@contextlib.contextmanager
def _collecting(log: contextvars.ContextVar) -> Iterator[list[tuple[str, str]]]:
    """A fresh list that ``log`` (a context variable of (op, why) lists) points at inside the block."""
    collected: list[tuple[str, str]] = []
    token = log.set(collected)
    try:
        yield collected
    finally:
        log.reset(token)


@contextlib.contextmanager
def record_fallbacks() -> Iterator[list[tuple[str, str]]]:
    """Collect ``(op, why)`` for every call in the block that a backend kernel declined (its ``supports`` hook,
    or gradients it cannot give), so that the reference ran instead. Static fallbacks (ops a backend does not
    implement) are not calls a kernel declined: :func:`runs_reference` answers for those. Calls traced by
    ``torch.compile`` are not recorded (reading the recorder would break the graph)."""
    with _collecting(_DECLINED_LOG) as declined:
        yield declined


@contextlib.contextmanager
def record_reference_runs() -> Iterator[list[tuple[str, str]]]:
    """Collect ``(op, why)`` for every call in the block that computed with the reference: calls a kernel
    declined and calls of ops the backend has no kernel for (a composite without a fused kernel records its
    parts' calls). What a training step's ``reference_ops`` metric and the benchmarks' path checks read.
    Calls traced by ``torch.compile`` are not recorded."""
    with _collecting(_REFERENCE_LOG) as ran:
        yield ran


def _log_reference_run(op: str, why: str) -> None:
    if not torch.compiler.is_compiling():
        ran = _REFERENCE_LOG.get()
        if ran is not None:
            ran.append((op, why))


def _declined_call(res: Resolution, why: str, args: tuple, kwargs: dict):
    """A kernel declined this call: the reference runs (strict mode: an error), recorded for conformance."""
    if strict_mode():
        raise BackendCoverageError(
            f"{res.op}: {res.backend} declines this call ({why}), and GLM5_STRICT=1 forbids the reference fallback")
    if not torch.compiler.is_compiling():
        declined = _DECLINED_LOG.get()
        if declined is not None:
            declined.append((res.op, why))
    _log_reference_run(res.op, why)
    return res.spec.reference(*args, **kwargs)


def _run(res: Resolution, via: BackendArg, args: tuple, kwargs: dict):
    """Run a resolved op: the kernel unless it declines, a composite's parts on the same backend (``via``:
    the binding or backend name the call came through), or the reference."""
    kernel = res.kernel
    if kernel is not None:
        why = kernel.declines(args, kwargs, outputs_have_gradients=not res.spec.gradient_free)
        if not why:
            return kernel.fn(*args, **kwargs)
        if res.spec.is_composite:  # a declining fused kernel: the backend's parts (a composite never declines)
            return res.spec.composite(*args, backend=via, **kwargs)
        return _declined_call(res, why, args, kwargs)
    if res.spec.is_composite:  # no fused kernel: the backend's own kernels for the parts
        return res.spec.composite(*args, backend=via, **kwargs)
    if strict_mode():
        raise _strict_fallback_error(res)
    if res.is_reference:
        _log_reference_run(res.op, res.reason)
    return res.impl(*args, **kwargs)


def call(op: str, *args, backend: BackendArg = None, **kwargs):
    """Dispatch ``op`` to the resolved implementation. Arguments are already validated by ``glm5_core.ops``."""
    if isinstance(backend, Binding):
        return _run(backend.resolution(op), backend, args, kwargs)
    res = _lookup(op, backend)
    return _run(res, res.backend, args, kwargs)


# --------------------------------------------------------------------------------------------- reports
def explain(backend: Optional[str] = None, *, require: bool = True) -> list[Resolution]:
    """One :class:`Resolution` per op for ``backend`` (strict mode is not applied here).

    With ``require=False`` an unavailable backend is explained too (what its kernel table declares),
    so users can see what a vendor backend would run before they have the hardware."""
    name = resolve_backend_name(backend)
    be = require_available(name) if require else get_backend(name)
    table = _kernel_table(name)
    return [_resolve_in(spec, name, be, table) for spec in op_specs().values()]


def runs_reference(op: str, backend: Optional[str] = None) -> bool:
    """``op`` computes with the reference on ``backend``: no kernel of its own, or (a composite without a
    fused kernel) every part falls back."""
    res = resolve(op, backend)
    if res.spec.is_composite and res.kernel is None:
        return all(runs_reference(part, backend) for part in res.spec.parts)
    return res.is_reference


def missing_ops(backend: str) -> list[str]:
    """Ops that ``backend`` leaves to the reference."""
    return [op for op in op_specs() if runs_reference(op, backend)]
