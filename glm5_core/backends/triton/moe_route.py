"""MoE routing fused per token as one Triton kernel: score, bias, group limit, top-k, renormalise, scale.

Legend: N tokens, E experts (E_PAD padded to a power of two), G groups (G_PAD), K experts per token,
        BN tokens per program.

Per token (one row of a [BN, E_PAD] tile):
  scores  = sigmoid(logits) | softmax(logits)                     fp32
  select  = scores + bias                                         (bias steers selection only)
  groups  : a group scores as the sum of its top-2 selection scores; the best ``topk_group`` groups
            stay eligible (argmax with ties to the lower group id, ``topk_group`` times)
  experts : ``top_k`` rounds of argmax (ties to the LOWER expert id), each winner masked out, so ids
            come out in selection order
  weights = unbiased scores of the winners, / (sum + 1e-20) if renormalising, * routed_scaling_factor
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5_core.backends.triton import _util
from glm5_core.backends.triton.launch import KernelConfigs, LaunchConfig, bind
from glm5_core.backends.triton.shared_memory import ModelDims, Tile
from glm5_core.kernel import Kernel
from glm5_core.ops.moe import RENORM_EPS


@triton.jit
def _group_keep_mask(select, offs_e, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     G_PAD: tl.constexpr):
    """[BN, E_PAD] bool: experts whose group is among the TOPK_GROUP best (group score = top-2 sum)."""
    offs_g = tl.arange(0, G_PAD)
    in_group = (offs_e // PER_GROUP)[None, None, :] == offs_g[None, :, None]  # [1, G_PAD, E_PAD]
    grouped = tl.where(in_group, select[:, None, :], float("-inf"))  # [BN, G_PAD, E_PAD]
    top1 = tl.max(grouped, axis=2)  # [BN, G_PAD]
    if PER_GROUP >= 2:
        first = tl.argmax(grouped, axis=2, tie_break_left=True)  # [BN, G_PAD]
        rest = tl.where(offs_e[None, None, :] == first[:, :, None], float("-inf"), grouped)
        group_score = top1 + tl.max(rest, axis=2)
    else:
        group_score = top1
    group_score = tl.where(offs_g[None, :] < N_GROUP, group_score, float("-inf"))
    kept = tl.zeros(group_score.shape, tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(group_score, axis=1, tie_break_left=True)  # [BN]
        hit = offs_g[None, :] == best[:, None]
        kept = tl.where(hit, 1, kept)
        group_score = tl.where(hit, float("-inf"), group_score)
    kept_e = tl.max(tl.where(in_group, kept[:, :, None], 0), axis=1)  # [BN, E_PAD]
    return kept_e != 0


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, N, E, stride_n, scaling,
                  HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                  N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, G_PAD: tl.constexpr,
                  BN: tl.constexpr):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_e = tl.arange(0, E_PAD)
    live = (offs_n[:, None] < N) & (offs_e[None, :] < E)
    x = tl.load(logits_ptr + offs_n[:, None].to(tl.int64) * stride_n + offs_e[None, :], mask=live,
                other=0.0).to(tl.float32)
    x = tl.where(offs_e[None, :] < E, x, float("-inf"))  # padded experts never win (rows past N stay finite)
    if SOFTMAX:
        ex = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = ex / tl.sum(ex, axis=1)[:, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    select = scores
    if HAS_BIAS:
        select += tl.load(bias_ptr + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)[None, :]
    select = tl.where(offs_e[None, :] < E, select, float("-inf"))
    if N_GROUP > 1:
        select = tl.where(_group_keep_mask(select, offs_e, N_GROUP, PER_GROUP, TOPK_GROUP, G_PAD), select,
                          float("-inf"))
    offs_k = tl.arange(0, K_PAD)
    ids = tl.zeros([BN, K_PAD], tl.int32)
    weights = tl.zeros([BN, K_PAD], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(select, axis=1, tie_break_left=True)  # [BN]
        hit = offs_e[None, :] == best[:, None]
        ids = tl.where(offs_k[None, :] == j, best[:, None], ids)
        weights = tl.where(offs_k[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], weights)
        select = tl.where(hit, float("-inf"), select)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling
    out_mask = (offs_n[:, None] < N) & (offs_k[None, :] < TOP_K)
    out_offs = offs_n[:, None].to(tl.int64) * TOP_K + offs_k[None, :]
    tl.store(weights_ptr + out_offs, weights, mask=out_mask)
    tl.store(ids_ptr + out_offs, ids, mask=out_mask)


def route(logits, bias, *, top_k: int, score_func: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
          renormalize: bool = True, routed_scaling_factor: float = 1.0, config: LaunchConfig):
    """``moe_route``: (weights fp32 [N, K], expert ids int32 [N, K])."""
    assert RENORM_EPS == 1e-20  # the kernel hard-codes the reference's epsilon
    N, E = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    bias = bias.contiguous() if bias is not None else None  # the kernel reads bias[e] at offset e
    weights = torch.empty((N, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((N, top_k), dtype=torch.int32, device=logits.device)
    BN = config.block("tokens")
    _route_kernel[(triton.cdiv(N, BN),)](
        logits, bias if bias is not None else logits, weights, ids, N, E, logits.stride(0),
        float(routed_scaling_factor), HAS_BIAS=bias is not None, SOFTMAX=score_func == "softmax",
        RENORM=renormalize, N_GROUP=n_group, PER_GROUP=E // n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        K_PAD=_util.next_pow2(top_k), E_PAD=_util.next_pow2(E), G_PAD=_util.next_pow2(n_group), BN=BN,
        **config.launch_kwargs())
    return weights, ids


def supports(logits, bias=None, *, top_k: int, n_group: int = 1, **kwargs):
    why = _util.float_dtype_verdict("logits", logits)
    if why:
        return False, why
    if logits.shape[1] > 1024:
        return False, f"E={logits.shape[1]} experts > 1024 do not fit one register tile"
    if n_group * _util.next_pow2(logits.shape[1]) > 8192:
        return False, f"n_group={n_group} x E={logits.shape[1]} group tile too large"
    if top_k > 64:
        return False, f"top_k={top_k} > 64"
    return True, ""


# ---- the kernel-module protocol (``table.py``): launch family, shared-memory tiles, kernel-table entries ----
FAMILY = "moe_route"  # this module's launch configuration
DEFAULT_LAUNCH = LaunchConfig(num_warps=4, num_stages=1, blocks={"tokens": 16})  # unless the vendor overrides it
ITEMSIZES = (4,)


def tiles(blocks, dims: ModelDims, itemsize: int) -> dict[str, list[Tile]]:
    E_PAD = _util.next_pow2(dims.experts)
    return {"route": [Tile("scores", (blocks["tokens"], E_PAD), 4, scratch=True)]}  # argmax / max / sum over experts


def kernels(configs: KernelConfigs) -> dict[str, Kernel]:
    return {"moe_route": bind(route, configs.get(FAMILY, DEFAULT_LAUNCH), supports)}
