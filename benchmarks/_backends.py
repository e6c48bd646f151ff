"""Which backends the benchmarks time (``--backends`` / ``GLM5_BENCH_BACKENDS``), and the ``impl`` a
benchmark receives for each (imported as ``_backends`` from the benchmarks' folder and by its conftest).

A request is ``all`` (the default: every available backend running on its own device, so not cuda under
Triton's interpreter, which runs by name only) or a comma-separated list of backend names
(``glm5 backends`` lists them) and ``reference``. For every device the requested backends run on, a
benchmark taking the ``impl`` fixture is parametrized over the reference on that device, the peers its
``@pytest.mark.peers(...)`` names (what a user would pick instead: transformers' path, torch.optim.Muon),
then each requested backend of that device; all on the same inputs. A requested backend that cannot run
here is kept as a skipped case whose reason is the backend's own (``registry.get_backend(name).available()``).
``GLM5_BENCH_TINY=1`` shrinks the default sizes to seconds (for the tests of the benchmarks themselves).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

ENV = "GLM5_BENCH_BACKENDS"
TINY_ENV = "GLM5_BENCH_TINY"
REFERENCE = "reference"


def tiny() -> bool:
    """Whether ``GLM5_BENCH_TINY`` asks for the tiny sizes."""
    return os.environ.get(TINY_ENV, "0") not in ("", "0")


def sizes(default: list, tiny_sizes: list) -> list:
    """``default``, or ``tiny_sizes`` under ``GLM5_BENCH_TINY=1``."""
    return tiny_sizes if tiny() else default


def parse_request(text: Optional[str]) -> list[str]:
    """The backend names of a request (``all`` or a comma-separated list), validated against the known ones.

    Raises ValueError naming ``--backends``, what was expected and what was given (with a did-you-mean)."""
    from glm5_core import registry

    known = list(registry.backends())
    text = (text or "all").strip()
    if text.lower() == "all":  # emulated backends (cuda under Triton's interpreter: cpu tensors) only by name
        return [REFERENCE] + [name for name, backend in registry.backends().items()
                              if backend.available()[0] and backend.device() == backend.device_type]
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"--backends: expected 'all' or a comma-separated list of {', '.join([REFERENCE] + known)}, "
                         f"got {text!r}")
    for name in names:
        if name not in known and name != REFERENCE:
            close = difflib.get_close_matches(name.lower(), known + [REFERENCE, "all"], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"--backends: expected 'all' or a comma-separated list of "
                             f"{', '.join([REFERENCE] + known)}, got {name!r}{hint}")
    return list(dict.fromkeys(names))


def _synchronizer(device: str) -> Callable[[], None]:
    module = getattr(torch, device, None)  # torch.cuda, torch.npu (torch_npu registers it), ...
    sync = getattr(module, "synchronize", None) if device != "cpu" else None
    return sync if callable(sync) else (lambda: None)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation a benchmark times: the reference, a peer, or a backend's kernels, on ``device``."""

    name: str  # "reference", a peer's name, or a backend's name
    kind: str  # "reference" | "peer" | "backend"
    device: str

    @property
    def id(self) -> str:
        return self.name if self.device == "cpu" else f"{self.name}@{self.device}"

    def op(self, op: str, required: bool = True) -> Callable:
        """What runs ``op`` here: the reference, or what the backend resolves it to. A ``required`` op the
        backend would run the reference for skips the case (nothing of the backend's own to time)."""
        from glm5_core import registry

        if self.kind == "reference":
            return registry.reference(op)
        if self.kind != "backend":
            raise TypeError(f"op: expected the reference or a backend, got the peer {self.name!r}")
        resolution = registry.resolve(op, self.name)
        if resolution.is_reference and required:
            import pytest

            pytest.skip(f"{self.name}: {op} runs the reference here ({resolution.reason})")
        return resolution.impl

    def to(self, value: Any) -> Any:
        """``value`` (a tensor, or a dict / list / tuple of them) on this device."""
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, dict):
            return {k: self.to(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.to(v) for v in value)
        return value

    def timed(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` followed by a device synchronisation, so a round's time covers the work it launched."""
        sync = _synchronizer(self.device)

        def run():
            out = fn()
            sync()
            return out

        return run

    def group(self, text: str) -> str:
        """A benchmark group per device: implementations are compared with the reference on the same device."""
        return f"{text} [{self.device}]"


def impls(requested: Sequence[str], peers: Sequence[str] = ()) -> list[tuple[Impl, Optional[str]]]:
    """``[(impl, skip_reason or None)]`` for the requested backends: per device (cpu first), the reference,
    the peers, then the backends; unavailable backends with their reason."""
    from glm5_core import registry

    backends = registry.backends()
    chosen = [name for name in requested if name != REFERENCE]
    state = {name: backends[name].available() for name in chosen}

    def device_of(name: str) -> str:
        return backends[name].device() if state[name][0] else backends[name].device_type

    devices = list(dict.fromkeys(["cpu"] * (REFERENCE in requested) + [device_of(n) for n in chosen if state[n][0]]))
    out: list[tuple[Impl, Optional[str]]] = []
    for device in devices:
        out.append((Impl(REFERENCE, "reference", device), None))
        out += [(Impl(peer, "peer", device), None) for peer in peers]
        out += [(Impl(name, "backend", device), None) for name in chosen
                if state[name][0] and device_of(name) == device]
    out += [(Impl(name, "backend", device_of(name)), f"{name}: {state[name][1]}") for name in chosen
            if not state[name][0]]
    return out
