"""Small helpers shared by the launchers (no triton import here)."""
from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
Verdict = tuple[bool, str]


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def float_dtype_verdict(name: str, t: torch.Tensor) -> Optional[str]:
    """Why the kernels decline ``t`` (fp64 inputs run the fp64 reference), or None."""
    if t.dtype not in SUPPORTED_FLOATS:
        return f"{name} is {t.dtype}; the Triton kernels take fp16/bf16/fp32 (fp64 runs the reference)"
    return None


def start_tensor(start_pos, batch: int, device: torch.device) -> torch.Tensor:
    """``start_pos`` (int or [B] int tensor) as an int32 [B] tensor on ``device``."""
    if isinstance(start_pos, torch.Tensor):
        return start_pos.to(device=device, dtype=torch.int32).contiguous()
    return torch.full((batch,), int(start_pos), dtype=torch.int32, device=device)
