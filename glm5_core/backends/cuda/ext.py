"""Loader of the CUDA deterministic top-k in ``csrc/deterministic_topk.cu`` (JIT-built, cached).

Built with ``torch.utils.cpp_extension.load`` on first use (a TORCH_LIBRARY operator,
``torch.ops.glm5_cuda.deterministic_topk``), only where a CUDA toolkit (nvcc) and a
CUDA build of torch are present; ``GLM5_SKIP_EXT=1`` skips it. It builds into the glm5_core
extension cache (``glm5_core.backends.jit_build``), one process at a time. ``load_extension()`` returns
``(operator or None, reason)`` and is cached for the process, so a failed build is tried once.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from glm5_core.backends import jit_build

EXTENSION_NAME = "glm5_cuda_deterministic_topk"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"  # the .cu / .cuh sources, shipped in the package
MAX_K = 2048  # glm5::kTopkMaxK in csrc/deterministic_topk.cuh


def toolchain_verdict() -> Optional[str]:
    """Why the extension cannot be built here, or None."""
    if os.environ.get("GLM5_SKIP_EXT", "0") not in ("", "0"):
        return "GLM5_SKIP_EXT=1"
    if torch.version.cuda is None:
        return "this torch is not a CUDA build (torch.version.cuda is None)"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return "no CUDA toolkit found (CUDA_HOME unset and nvcc not on PATH)"
    return None


def nvcc_flags():
    return ["-O3", "-std=c++20", "-lineinfo"]


def build_directory() -> Path:
    """The cache folder of this build: keyed by the sources, the nvcc flags, torch's and CUDA's versions."""
    files = sorted(SOURCE_DIR.glob("*.cu")) + sorted(SOURCE_DIR.glob("*.cuh"))
    key = jit_build.build_key(files, (torch.__version__, str(torch.version.cuda), " ".join(nvcc_flags())))
    return jit_build.cache_root() / f"{EXTENSION_NAME}_{key}"


@functools.lru_cache(maxsize=1)
def load_extension():
    why = toolchain_verdict()
    if why:
        return None, why
    from torch.utils import cpp_extension

    source = SOURCE_DIR / "deterministic_topk.cu"
    try:
        build_dir = build_directory()
        with jit_build.exclusive_build(build_dir):  # a killed builder cannot leave later processes waiting
            cpp_extension.load(name=EXTENSION_NAME, sources=[str(source)], extra_include_paths=[str(source.parent)],
                               extra_cuda_cflags=nvcc_flags(), build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
    except Exception as exc:  # a failed build must leave the Triton path usable
        return None, f"building {source.name} failed: {exc!r}"
    return torch.ops.glm5_cuda.deterministic_topk, f"built {EXTENSION_NAME}"


def topk_from_scores(scores: torch.Tensor, topk: int, start_pos=0) -> torch.Tensor:
    """The DSA top-k contract over materialised, causally masked scores fp32 [B, T, S] -> int32 [B, T, topk].

    Runs the CUDA radix-select kernel, then applies the contract's -1 padding past min(topk, pos + 1)."""
    op, why = load_extension()
    if op is None:
        raise RuntimeError(f"deterministic top-k extension unavailable: {why}")
    B, T, S = scores.shape
    k = min(topk, S)
    if k > MAX_K:
        raise ValueError(f"topk: the CUDA top-k supports k <= {MAX_K}, got {k}")
    rows = scores.reshape(B * T, S).float().contiguous()  # [R, S]
    with torch.cuda.device(rows.device):
        picked = op(rows, k, torch.cuda.current_stream().cuda_stream).view(B, T, k)
    return pad_past_valid(picked, topk, start_pos)


def pad_past_valid(picked: torch.Tensor, topk: int, start_pos) -> torch.Tensor:
    """[B, T, k<=topk] ranked picks -> [B, T, topk] with -1 from rank min(topk, pos + 1) on."""
    from glm5_core.ops import _checks

    B, T, k = picked.shape
    S_limit = k
    if k < topk:
        picked = torch.cat([picked, picked.new_full((B, T, topk - k), -1)], dim=-1)
    pos = _checks.query_positions(start_pos, B, T, picked.device)  # [B, T]
    n_valid = torch.clamp(pos + 1, max=S_limit)  # [B, T]
    rank = torch.arange(topk, device=picked.device)
    return torch.where(rank < n_valid.unsqueeze(-1), picked, torch.full_like(picked, -1))
