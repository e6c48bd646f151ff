"""A base tree's native CPU extension beside this tree's, in one process, for interleaved A/B runs.

``build(base_tree)`` compiles the base tree's ``glm5_core/backends/cpu/csrc/cpu_*.cpp`` with its op namespace
renamed ``glm5_cpu`` -> ``glm5_cpu_base`` (two libraries cannot register the same op names), with this tree's
extension flags, into ``$GLM5_EXT_DIR/glm5_cpu_base_<key>`` (a minute or two the first time). ``kernels(variant)``
then makes every ``torch.ops.glm5_cpu.<op>`` call of the code run the base library ("old") or this tree's ("new"):
the backends look the namespace up on ``torch.ops`` at each call, so rebinding that one attribute swaps them all.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

from glm5_core.backends import jit_build
from glm5_core.backends.cpu import extension

BASE_NAMESPACE = extension.NAMESPACE + "_base"
_REGISTRATION = re.compile(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\(\s*" + extension.NAMESPACE + r"\s*,")


def build(base_tree: Path) -> None:
    """Compile (if needed) and load the base tree's extension as ``torch.ops.glm5_cpu_base``."""
    csrc = Path(base_tree) / "glm5_core" / "backends" / "cpu" / "csrc"
    sources, headers = sorted(csrc.glob("cpu_*.cpp")), sorted(csrc.glob("cpu_*.h"))
    if not sources:
        raise ValueError(f"base_tree: expected {csrc}/cpu_*.cpp sources, got none")
    extension.load()  # this tree's extension first (it registers the fake kernels of its namespace)
    isa, isa_flags = extension._isa()
    flags = extension.BASE_FLAGS + isa_flags
    key = jit_build.build_key(sources + headers, (torch.__version__, isa, " ".join(flags), BASE_NAMESPACE))
    build_dir = jit_build.cache_root() / f"{BASE_NAMESPACE}_{key}"
    renamed = build_dir / "src"
    renamed.mkdir(parents=True, exist_ok=True)
    for path in sources + headers:  # the headers beside the renamed sources, so their includes resolve
        text = path.read_text()
        if path.suffix == ".cpp":
            text = _REGISTRATION.sub(lambda m: f"TORCH_LIBRARY_{m.group(1)}({BASE_NAMESPACE},", text)
        target = renamed / path.name
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
    jit_build.load_library(build_dir, [renamed / p.name for p in sources], cflags=flags, ldflags=["-fopenmp"],
                           include_paths=[str(renamed)], what="the base tree's cpu extension",
                           minutes=extension.BUILD_MINUTES)


@contextlib.contextmanager
def kernels(variant: str):
    """Within the block, ``torch.ops.glm5_cpu`` is the base library ("old") or this tree's ("new")."""
    if variant not in ("old", "new"):
        raise ValueError(f"variant: expected 'old' or 'new', got {variant!r}")
    own = getattr(torch.ops, extension.NAMESPACE)
    if variant == "old":
        setattr(torch.ops, extension.NAMESPACE, getattr(torch.ops, BASE_NAMESPACE))
    try:
        yield
    finally:
        setattr(torch.ops, extension.NAMESPACE, own)
