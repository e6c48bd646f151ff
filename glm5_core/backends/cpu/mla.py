"""cpu backend kernel for dense MLA prefill: the expanded form through torch's fused CPU attention.

``mla_prefill`` expands the latent keys once (one GEMM over kv_b_proj's rows: k_nope and v side by side), joins
the rope part to the queries and keys, and runs ``F.scaled_dot_product_attention``. On CPU that dispatches to
torch's flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, forward and backward: online softmax,
nothing [T, S]-sized kept), which needs one head width for queries, keys and values; otherwise torch takes its
unfused math path. So the narrower side is zero-padded to the wider (values from Dv to Dn + Dr in the training
config, 48 vs 32; GLM-5's 192 + 64 = 256 = Dv needs none): zero columns add exact zeros to the scores, and the
padded output columns are dropped. Autograd differentiates every step (torch's kernel has its own backward).

Masks: ``start_pos == 0`` (an int) is sdpa's own causal mask (top-left aligned: query t sees keys 0..t, also for
T < S), anything else an explicit bool mask from ``ops.mla.causal_mask``. A query always sees key 0
(``start_pos >= 0`` is validated), so no row is fully masked.

dtypes: fp32 and bf16 compute in fp32 (``_checks.compute_dtype``, as the reference; the bf16 result is rounded
once, at the end), fp64 in fp64 (the flash kernel has an fp64 instantiation). Legend as in ``glm5_core.ops.mla``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from glm5_core.kernel import Kernel
from glm5_core.ops import _checks
from glm5_core.ops.mla import causal_mask


def _expand_keys(c_kv: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
    """k_nope [B, S, H, Dn] and v [B, S, H, Dv]: views of one GEMM of c_kv with w_uk and w_uv stacked per head."""
    B, S, C = c_kv.shape
    H, Dn, _ = w_uk.shape
    Dv = w_uv.shape[1]
    w_kv = torch.cat([w_uk, w_uv], dim=1).reshape(H * (Dn + Dv), C)  # [H * (Dn + Dv), C]
    kv = F.linear(c_kv, w_kv).view(B, S, H, Dn + Dv)  # [B, S, H, Dn + Dv]
    return kv.split([Dn, Dv], dim=-1)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero columns appended to its last dim up to ``width``."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def prefill(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale: float, start_pos=0) -> torch.Tensor:
    """[B, T, H, Dv] in the input dtype: the reference's contract (``ops.mla.prefill_reference``)."""
    out_dtype = q_nope.dtype
    ct = _checks.compute_dtype(out_dtype)
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (t.to(ct) for t in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    B, T, H, _ = q_nope.shape
    S, Dr, Dv = c_kv.shape[1], k_pe.shape[-1], w_uv.shape[1]
    k_nope, v = _expand_keys(c_kv, w_uk, w_uv)  # [B, S, H, Dn], [B, S, H, Dv]
    query = torch.cat([q_nope, q_pe], dim=-1)  # [B, T, H, Dn + Dr]
    key = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, S, H, Dr)], dim=-1)  # [B, S, H, Dn + Dr]
    width = max(query.shape[-1], Dv)  # the flash kernel's one head width
    query, key, v = (_pad_last(x, width).transpose(1, 2) for x in (query, key, v))  # [B, H, T or S, width]
    if isinstance(start_pos, int) and start_pos == 0:
        out = F.scaled_dot_product_attention(query, key, v, is_causal=True, scale=scale)  # [B, H, T, width]
    else:
        mask = causal_mask(start_pos, B, T, S, query.device).unsqueeze(1)  # [B, 1, T, S]
        out = F.scaled_dot_product_attention(query, key, v, attn_mask=mask, scale=scale)  # [B, H, T, width]
    return out[..., :Dv].transpose(1, 2).to(out_dtype)  # [B, T, H, Dv]


def _supports(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale: float, start_pos=0):
    devices = {t.device.type for t in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, start_pos) if isinstance(t, torch.Tensor)}
    if devices != {"cpu"}:
        return False, f"torch's CPU attention kernel needs CPU tensors, got {sorted(devices)}"
    return True, ""


# differentiable: autograd runs torch's flash-attention backward
KERNELS: Mapping[str, Kernel] = {"mla_prefill": Kernel(prefill, supports=_supports, differentiable=True)}
