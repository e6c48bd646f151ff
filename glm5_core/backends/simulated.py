"""A vendor's PyTorch stack simulated on the host: what ``glm5 conformance --backend X --simulate``,
``benchmarks/vendor/run.sh`` and the vendor tests run under, where the hardware is absent.

A vendor folder describes its stack's documented surface in ``simulated.py`` (``STACK``, a :class:`SimulatedStack`):
its torch device type, the extension module that registers it (or the torch build strings and ``torch.version``
attributes of a build that presents its devices under another device type), the device name, count and properties
its device module reports, and its SMI tools' outputs. :func:`simulate` installs that surface for the duration of a
block (an extension module in ``sys.modules``, ``torch.<device_type>`` answering as documented, the build strings,
the tools' outputs through ``vendor_stack.tool_output``), forgets the vendor probes' cached answers on entry and on
exit, checks that the backend detects the simulated device, and runs its kernels on CPU tensors: the Triton kernels
under ``TRITON_INTERPRET=1`` with the vendor's own launch configurations, torch-operator backends on ``cpu``
(:func:`runtime_device`). Results produced inside are marked simulated by their reports.

Nothing here runs at import; the surface is restored on exit (the block is not thread-safe: it patches ``torch``).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch

from glm5_core import platform, registry
from glm5_core.backends import vendor_stack

GIB = 1024 ** 3
# the backend whose stack is simulated in this context (None: none)
SIMULATED_BACKEND: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("glm5_simulated_backend",
                                                                                   default=None)


@dataclasses.dataclass(frozen=True)
class SimulatedStack:
    """The documented surface of a vendor's PyTorch stack (see the module docstring).

    ``module``: the extension module that registers ``device_type`` (None: the build presents its devices under an
    existing device type, whose ``torch.<device_type>`` functions are answered instead). ``torch_version``: the build
    string ``torch.__version__`` reads (None: this torch's). ``version_attrs``: ``torch.version`` attributes to set
    (None removes a value). ``tools``: SMI tool -> its output (a tool not named is not on PATH). ``properties``:
    further fields of ``get_device_properties``. ``source``: where the surface is documented."""

    device_type: str
    device_name: str
    device_count: int
    total_memory: int
    module: Optional[str] = None
    torch_version: Optional[str] = None
    version_attrs: Mapping[str, Optional[str]] = dataclasses.field(default_factory=dict)
    tools: Mapping[str, Optional[str]] = dataclasses.field(default_factory=dict)
    properties: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""

    def device_functions(self) -> dict[str, Any]:
        """What ``torch.<device_type>`` answers: availability, count, name, properties, the current device."""
        props = types.SimpleNamespace(name=self.device_name, total_memory=self.total_memory, **self.properties)

        def index(device=None) -> int:
            i = 0 if device is None else (device if isinstance(device, int) else (torch.device(device).index or 0))
            if not 0 <= i < self.device_count:
                raise RuntimeError(f"invalid device ordinal {i} (the simulated stack has {self.device_count})")
            return i

        return {
            "is_available": lambda: self.device_count > 0,
            "device_count": lambda: self.device_count,
            "get_device_name": lambda device=None: (index(device), self.device_name)[1],
            "get_device_properties": lambda device=None: (index(device), props)[1],
            "current_device": lambda: 0,
        }


def stack_of(name: str) -> SimulatedStack:
    """The simulated stack a built-in vendor folder declares (``glm5_core/backends/<name>/simulated.py``)."""
    registry.get_backend(name)  # an unknown name is a ValueError listing the known ones
    module = f"{registry.BUILTIN_PACKAGE}.{name}.simulated"
    if importlib.util.find_spec(module) is None:
        have = [n for n in registry.builtin_backend_names()
                if importlib.util.find_spec(f"{registry.BUILTIN_PACKAGE}.{n}.simulated") is not None]
        raise ValueError(f"backend: expected a backend with a simulated stack ({', '.join(have)}), got {name!r}")
    stack = importlib.import_module(module).STACK
    if not isinstance(stack, SimulatedStack):
        raise TypeError(f"{module}.STACK: expected a SimulatedStack, got {type(stack).__name__}")
    return stack


def forget_probes() -> None:
    """Forget every built-in vendor's cached device probe (``functools.cache`` functions of its ``device.py``), so
    the next probe asks the stack as it is now."""
    for name in registry.builtin_backend_names():
        module_name = f"{registry.BUILTIN_PACKAGE}.{name}.device"
        if importlib.util.find_spec(module_name) is None:
            continue
        for value in vars(importlib.import_module(module_name)).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


@contextlib.contextmanager
def _patched(obj: Any, values: Mapping[str, Any]) -> Iterator[None]:
    missing = object()
    saved = {key: getattr(obj, key, missing) for key in values}
    try:
        for key, value in values.items():
            setattr(obj, key, value)
        yield
    finally:
        for key, value in saved.items():
            if value is missing:
                delattr(obj, key)
            else:
                setattr(obj, key, value)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def simulate_stack(stack: SimulatedStack) -> Iterator[SimulatedStack]:
    """Install ``stack``'s surface for the block (no backend is checked; :func:`simulate` checks one)."""
    with contextlib.ExitStack() as undo:
        if stack.module is not None:
            fake = types.ModuleType(stack.module)
            fake.__version__ = "simulated"
            fake.SIMULATED = True
            device_module = types.ModuleType(f"torch.{stack.device_type}")
            for key, fn in stack.device_functions().items():
                setattr(device_module, key, fn)
            before = sys.modules.get(stack.module)
            sys.modules[stack.module] = fake
            undo.callback(lambda: sys.modules.__setitem__(stack.module, before) if before is not None
                          else sys.modules.pop(stack.module, None))
            undo.enter_context(_patched(torch, {stack.device_type: device_module}))
        else:
            undo.enter_context(_patched(getattr(torch, stack.device_type), stack.device_functions()))
        if stack.torch_version is not None:
            from torch.torch_version import TorchVersion  # compares as a version, as torch.__version__ does

            undo.enter_context(_patched(torch, {"__version__": TorchVersion(stack.torch_version)}))
        undo.enter_context(_patched(torch.version, dict(stack.version_attrs)))
        token = vendor_stack.SIMULATED_TOOLS.set(dict(stack.tools))
        undo.callback(vendor_stack.SIMULATED_TOOLS.reset, token)
        forget_probes()
        undo.callback(forget_probes)
        yield stack


@contextlib.contextmanager
def simulate(name: str, *, interpret: bool = True) -> Iterator[str]:
    """Run the block on backend ``name``'s simulated device (see the module docstring); yields the device probe's
    reason (``N x <device name> ...``). ``interpret``: set ``TRITON_INTERPRET=1`` for the block (Triton's interpreter
    must not have been replaced by the compiler in this process yet: set it before Python starts otherwise)."""
    stack = stack_of(name)
    backend = registry.get_backend(name)
    with contextlib.ExitStack() as undo:
        if interpret:
            undo.enter_context(_environment("TRITON_INTERPRET", "1"))
            late = platform.triton_interpreter_too_late()
            if late:
                raise ValueError(f"--simulate: {late}")
        undo.enter_context(simulate_stack(stack))
        token = SIMULATED_BACKEND.set(name)
        undo.callback(SIMULATED_BACKEND.reset, token)
        device = importlib.import_module(f"{registry.BUILTIN_PACKAGE}.{name}.device")
        ok, reason = device.probe()
        if not ok or not backend.detect():
            raise ValueError(f"--simulate: {name}: the simulated stack is not detected: {reason}")
        yield f"simulated {reason}"


def runtime_device(name: str, device_type: str) -> str:
    """Where backend ``name``'s tensors live: ``cpu`` while its stack is simulated, else ``device_type``."""
    return "cpu" if SIMULATED_BACKEND.get() == name else device_type
