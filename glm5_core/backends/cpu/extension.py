"""Builds and loads the native CPU extension (``csrc/cpu_*.cpp``) on first use, never at import.

torch's ``cpp_extension`` compiles the sources with ninja into a cache folder keyed by everything that
changes the binary: the sources, the compile flags, the CPU's vector ISA (the flags target it, so a
cache shared between machines never runs AVX-512 code on an AVX2 CPU), torch (version and commit) and
Python versions. Later processes, from any clone or venv, load the cached library without compiling; one
process builds a folder at a time, announcing it on stderr (``glm5_core.backends.jit_build``: a builder that
was killed leaves nobody waiting, and two source trees never rebuild each other's build). The library
registers its kernels as ``torch.ops.glm5_cpu.*`` custom ops; their fake (meta) implementations are
registered here so ``torch.compile`` can trace through them.

Environment:
  GLM5_SKIP_EXT=1      do not build or load the extension (the cpu backend then runs the reference)
  GLM5_EXT_DIR         cache root (default: $XDG_CACHE_HOME/glm5_core/ext, else ~/.cache/glm5_core/ext)
  GLM5_EXT_VERBOSE=1   show the compiler's output
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from glm5_core.backends import jit_build

NAMESPACE = "glm5_cpu"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"  # cpu_*.cpp / cpu_*.h, shipped in the package
BASE_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17")
BUILD_MINUTES = 3  # a first build's typical time (2 min 55 s measured on a 2-core machine), said when building

# torch's CPU capability -> compiler flags (x86 only; other ISAs build the portable 16-byte-vector code).
_ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    """Whether the native extension is loaded, and why not when it is not."""

    built: bool
    reason: str
    build_dir: Optional[str] = None
    isa: str = ""

    def describe(self) -> str:
        if self.built:
            return f"native extension built ({self.isa}, {self.build_dir})"
        return f"native extension not built: {self.reason}"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def _sources() -> tuple[list[Path], list[Path]]:
    root = SOURCE_DIR
    return sorted(root.glob("cpu_*.cpp")), sorted(root.glob("cpu_*.h"))


def _isa() -> tuple[str, tuple[str, ...]]:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability, _ISA_FLAGS.get(capability, ())


def _build_key(files: list[Path], flags: tuple[str, ...], isa: str) -> str:
    import torch

    return jit_build.build_key(files, (torch.__version__, str(torch.version.git_version), sys.version, isa,
                                       " ".join(flags)))


def build_directory() -> Path:
    """This build's cache folder, ``<cache root>/glm5_cpu_<key>`` (see ``glm5_core.backends.jit_build``)."""
    sources, headers = _sources()
    isa, isa_flags = _isa()
    return jit_build.cache_root() / f"{NAMESPACE}_{_build_key(sources + headers, BASE_FLAGS + isa_flags, isa)}"


def _last_lines(text: str, count: int = 6) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:])


@functools.lru_cache(maxsize=1)
def load() -> ExtensionStatus:
    """Build (if needed) and load the extension once per process; never raises."""
    if _env_flag("GLM5_SKIP_EXT"):
        return ExtensionStatus(False, "GLM5_SKIP_EXT=1 skips it")
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # a broken torch install must not break the reference path
        return ExtensionStatus(False, f"torch.utils.cpp_extension unavailable: {exc!r}")
    sources, _ = _sources()
    if not sources:
        return ExtensionStatus(False, "no csrc/cpu_*.cpp sources in the installed package "
                                      "(glm5_core/backends/cpu/csrc)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return ExtensionStatus(False, f"no C++ compiler ({compiler!r} not on PATH; set CXX)")
    if not cpp_extension.is_ninja_available():
        return ExtensionStatus(False, "ninja is not installed (pip install ninja)")
    isa, isa_flags = _isa()
    flags = BASE_FLAGS + isa_flags
    build_dir = build_directory()
    try:
        jit_build.load_library(build_dir, sources, cflags=flags, ldflags=["-fopenmp"],
                               include_paths=[str(sources[0].parent)], what="the cpu extension",
                               minutes=BUILD_MINUTES, verbose=_env_flag("GLM5_EXT_VERBOSE"))
    except Exception as exc:
        return ExtensionStatus(False, f"build failed in {build_dir}: {_last_lines(exc)} "
                                      "(GLM5_EXT_VERBOSE=1 shows the compiler output)", str(build_dir), isa)
    from glm5_core.backends.cpu import fake_impls

    missing = [op for op in fake_impls.NATIVE_OPS if not hasattr(getattr(torch.ops, NAMESPACE), op)]
    if missing:
        return ExtensionStatus(False, f"extension loaded but lacks ops {missing}", str(build_dir), isa)
    fake_impls.register()
    return ExtensionStatus(True, "", str(build_dir), isa)
