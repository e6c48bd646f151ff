"""MLA decode on Ascend: ``npu_fused_infer_attention_score`` in its MLA form (query_rope / key_rope given).

Legend: B batch, T new queries, S cache slots, H heads, Dn / Dr / Dv head dims, C latent width.

Our contract vs the vendor op: the vendor attends over a paged latent cache with the absorbed query
(q_nope @ W_UK, 512 wide) plus the rope part, exactly our absorbed form, and returns the latent output
[B, T, H, 512]; W_UV is applied here. Our cache is contiguous [B, S, C]; it is cut into 128-slot blocks
(a copy when S is not a multiple of 128). Our causal rule (query t of row b sees keys 0 .. start_pos[b] + t)
becomes actual_seq_lengths_kv = start_pos + T with the bottom-right causal mode for T > 1.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from glm5_core.backends.ascend import mla_layouts as L
from glm5_core.backends.ascend.vendor import HALF_DTYPES, Decision, dtype_in, first_output, npu_kernel, vendor_ops
from glm5_core.kernel import Kernel
from glm5_core.ops.mla import project_output

DECODE_HEADS = (32, 64, 128)
DECODE_MAX_QUERIES = 16
DECODE_LATENT = 512
DECODE_ROPE = 64


def decode_limits(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale: float, start_pos) -> Decision:
    """The MLA limits of npu_fused_infer_attention_score
    (op-plugin/docs/context/torch_npu-npu_fused_infer_attention_score.md)."""
    op = "npu_fused_infer_attention_score"
    T, H = q_nope.shape[1], q_nope.shape[2]
    C, Dr = c_kv.shape[-1], k_pe.shape[-1]
    if C != DECODE_LATENT or Dr != DECODE_ROPE:
        return False, f"{op} (MLA) needs latent {DECODE_LATENT} + rope {DECODE_ROPE}, got {C} + {Dr}"
    if H not in DECODE_HEADS:
        return False, f"{op} (MLA) takes {DECODE_HEADS} query heads, got {H}"
    if T > DECODE_MAX_QUERIES:
        return False, f"{op} (MLA) takes 1..{DECODE_MAX_QUERIES} queries per row, got T={T}"
    return dtype_in("q_nope", q_nope, HALF_DTYPES, op)


def decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale: float, start_pos,
           npu: Optional[object] = None) -> torch.Tensor:
    """Absorbed-form MLA against the latent cache: [B, T, H, Dv] in the input dtype."""
    ops = vendor_ops(npu)
    call = L.decode_call(q_nope, q_pe, c_kv, k_pe, w_uk, scale, start_pos)
    o_lat = first_output(ops.npu_fused_infer_attention_score(*call.args(), **call.kwargs()))  # [B, T, H, C]
    return project_output(o_lat.float(), w_uv.float()).to(q_nope.dtype)  # [B, T, H, Dv]


KERNELS: Mapping[str, Kernel] = {
    "mla_decode": npu_kernel(decode, decode_limits,
                             lambda q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, **kw: (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv),
                             "npu_fused_infer_attention_score"),
}
