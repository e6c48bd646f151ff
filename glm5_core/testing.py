"""Input makers, tolerance tables and comparators shared by tests/, benchmarks/ and ``glm5 conformance``.

Floating outputs are judged the flash-attention way: against an fp64 run of the reference, a backend's
error may be at most ``ERROR_FACTOR`` times the error of the reference run at the same precision, plus
the per-dtype ``atol`` of :data:`TOLERANCES` (which also covers outputs that are exact in both).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import torch

# dtype -> (atol, rtol) for outputs compared directly; also the additive slack of ``assert_close_to_fp64``.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
ERROR_FACTOR = 2.0
FLOAT_DTYPES_UNDER_TEST = (torch.float32, torch.bfloat16, torch.float16)

TIE_MODES = (None, "zero_relu", "duplicate_keys", "bf16_quantised", "integer")


def generator(seed: int, device: str = "cpu") -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(shape: Sequence[int], *, seed: int, dtype=torch.float32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    """Seeded normal samples made on CPU (same values on every device), then moved and cast."""
    t = torch.randn(tuple(shape), generator=generator(seed), dtype=torch.float64) * scale
    return t.to(device=device, dtype=dtype)


def randint_like_scores(shape: Sequence[int], *, seed: int, low: int, high: int, dtype, device="cpu") -> torch.Tensor:
    """Small integers: products and sums stay exact in fp32/bf16, so every summation order agrees bitwise."""
    t = torch.randint(low, high, tuple(shape), generator=generator(seed))
    return t.to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------- MLA
@dataclasses.dataclass(frozen=True)
class MLAShape:
    B: int
    T: int
    S: int
    H: int
    Dn: int
    Dr: int
    Dv: int
    C: int

    def __str__(self) -> str:
        return f"B{self.B}T{self.T}S{self.S}H{self.H}n{self.Dn}r{self.Dr}v{self.Dv}c{self.C}"


MLA_SHAPES = (
    MLAShape(B=1, T=1, S=1, H=1, Dn=8, Dr=4, Dv=8, C=16),
    MLAShape(B=2, T=5, S=13, H=3, Dn=12, Dr=6, Dv=10, C=24),
    MLAShape(B=3, T=17, S=17, H=2, Dn=16, Dr=8, Dv=16, C=40),
)
# GLM-5's latent widths (512 + 64), so vendor kernels with fixed head dims are exercised, not declined.
VENDOR_MLA_SHAPES = (
    MLAShape(B=2, T=1, S=300, H=32, Dn=16, Dr=64, Dv=16, C=512),
    MLAShape(B=2, T=3, S=300, H=32, Dn=16, Dr=64, Dv=16, C=512),
)


def make_mla_inputs(shape: MLAShape, *, dtype=torch.float32, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    s = shape
    return {
        "q_nope": randn((s.B, s.T, s.H, s.Dn), seed=seed, dtype=dtype, device=device),
        "q_pe": randn((s.B, s.T, s.H, s.Dr), seed=seed + 1, dtype=dtype, device=device),
        "c_kv": randn((s.B, s.S, s.C), seed=seed + 2, dtype=dtype, device=device),
        "k_pe": randn((s.B, s.S, s.Dr), seed=seed + 3, dtype=dtype, device=device),
        "w_uk": randn((s.H, s.Dn, s.C), seed=seed + 4, dtype=dtype, device=device, scale=s.C ** -0.5),
        "w_uv": randn((s.H, s.Dv, s.C), seed=seed + 5, dtype=dtype, device=device, scale=s.C ** -0.5),
    }


def start_positions_for(B: int, T: int, S: int, mode: str, device="cpu"):
    """``last``: queries are the last T slots; ``first``: positions 0..T-1; ``ragged``: per-row tensor."""
    if mode == "first":
        return 0
    if mode == "last":
        return S - T
    if mode == "ragged":
        return torch.tensor([(S - T) * (b % 3) // 2 for b in range(B)], dtype=torch.int64, device=device)
    raise ValueError(f"mode: expected 'first', 'last' or 'ragged', got {mode!r}")


# --------------------------------------------------------------------------------------------- DSA
@dataclasses.dataclass(frozen=True)
class IndexerShape:
    B: int
    T: int
    S: int
    H: int
    D: int
    K: int

    def __str__(self) -> str:
        return f"B{self.B}T{self.T}S{self.S}H{self.H}D{self.D}K{self.K}"


INDEXER_SHAPES = (
    IndexerShape(B=1, T=1, S=1, H=1, D=8, K=1),
    IndexerShape(B=2, T=7, S=37, H=3, D=16, K=5),
    IndexerShape(B=2, T=13, S=13, H=4, D=24, K=16),  # k larger than the visible keys of early rows
    IndexerShape(B=1, T=9, S=70, H=2, D=32, K=33),
)
# GLM-5's indexer head dim (128) and a vendor-sized head count, for kernels with fixed dims.
VENDOR_INDEXER_SHAPE = IndexerShape(B=2, T=5, S=300, H=32, D=128, K=64)


def make_indexer_inputs(shape: IndexerShape, *, dtype=torch.float32, device="cpu", seed: int = 0,
                        ties: Optional[str] = None, weights_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """q [B,T,H,D], k [B,S,D], w [B,T,H] (w in ``weights_dtype``). ``ties`` makes tie-heavy inputs:

    - ``zero_relu``: q . k <= 0 everywhere (k >= 0, q <= 0), so every score is exactly 0;
    - ``duplicate_keys``: keys repeat with period 3, so equal scores appear at distinct indices;
    - ``bf16_quantised``: inputs rounded to bf16 with few distinct values, many exact ties;
    - ``integer``: small integers; scores are exact in any summation order.
    """
    s = shape
    if ties not in TIE_MODES:
        raise ValueError(f"ties: expected one of {TIE_MODES}, got {ties!r}")
    if ties == "integer":
        q = randint_like_scores((s.B, s.T, s.H, s.D), seed=seed, low=-2, high=3, dtype=dtype, device=device)
        k = randint_like_scores((s.B, s.S, s.D), seed=seed + 1, low=-2, high=3, dtype=dtype, device=device)
        w = randint_like_scores((s.B, s.T, s.H), seed=seed + 2, low=0, high=3, dtype=weights_dtype, device=device)
        return {"q": q, "k": k, "w": w}
    q = randn((s.B, s.T, s.H, s.D), seed=seed, dtype=torch.float32)
    k = randn((s.B, s.S, s.D), seed=seed + 1, dtype=torch.float32)
    w = randn((s.B, s.T, s.H), seed=seed + 2, dtype=torch.float32).abs() * s.H ** -0.5
    if ties == "zero_relu":
        q, k = -q.abs(), k.abs()
    elif ties == "duplicate_keys":
        k = k[:, torch.arange(s.S) % 3]
    elif ties == "bf16_quantised":
        q = (q * 2).round().to(torch.bfloat16).float() / 2
        k = (k * 2).round().to(torch.bfloat16).float() / 2
        w = torch.ones_like(w)
    return {"q": q.to(device=device, dtype=dtype), "k": k.to(device=device, dtype=dtype),
            "w": w.to(device=device, dtype=weights_dtype)}


def make_sparse_inputs(shape: MLAShape, K: int, *, dtype=torch.float32, device="cpu", seed: int = 0,
                       start_pos=None) -> dict[str, torch.Tensor]:
    """MLA inputs plus causal top-k style indices [B, T, K]: distinct visible keys, -1 padded, and one
    query row (the first of batch row 0) with no key at all."""
    inputs = make_mla_inputs(shape, dtype=dtype, device=device, seed=seed)
    s = shape
    if start_pos is None:
        start_pos = s.S - s.T
    g = generator(seed + 7)
    idx = torch.full((s.B, s.T, K), -1, dtype=torch.int32)
    for b in range(s.B):
        base = int(start_pos[b]) if isinstance(start_pos, torch.Tensor) else int(start_pos)
        for t in range(s.T):
            visible = base + t + 1
            n = min(K, visible)
            idx[b, t, :n] = torch.randperm(visible, generator=g)[:n].to(torch.int32)
    idx[0, 0] = -1
    inputs["topk_idx"] = idx.to(device)
    return inputs


def make_sparse_expanded_inputs(shape: MLAShape, K: int, *, dtype=torch.float32, device="cpu", seed: int = 0,
                                start_pos=None) -> dict[str, torch.Tensor]:
    """The inputs of ``dsa.sparse_prefill_expanded``: those of ``make_sparse_inputs`` with the latent rows expanded
    (k_nope [B, S, H, Dn] = c_kv W_UK^T, v [B, S, H, Dv] = c_kv W_UV^T, computed in fp32, rounded to ``dtype``)."""
    x = make_sparse_inputs(shape, K, dtype=dtype, device=device, seed=seed, start_pos=start_pos)
    c_kv = x.pop("c_kv").float()
    k_nope = torch.einsum("bsc,hdc->bshd", c_kv, x.pop("w_uk").float())  # [B, S, H, Dn]
    v = torch.einsum("bsc,hvc->bshv", c_kv, x.pop("w_uv").float())  # [B, S, H, Dv]
    return {"q_nope": x["q_nope"], "q_pe": x["q_pe"], "k_nope": k_nope.to(dtype), "k_pe": x["k_pe"],
            "v": v.to(dtype), "topk_idx": x["topk_idx"]}


# --------------------------------------------------------------------------------------------- MoE
@dataclasses.dataclass(frozen=True)
class MoEShape:
    N: int
    E: int
    K: int
    G: int
    TG: int
    D: int
    F: int

    def __str__(self) -> str:
        return f"N{self.N}E{self.E}K{self.K}G{self.G}of{self.TG}D{self.D}F{self.F}"


MOE_SHAPES = (
    MoEShape(N=1, E=4, K=1, G=1, TG=1, D=8, F=4),
    MoEShape(N=37, E=12, K=3, G=1, TG=1, D=24, F=10),
    MoEShape(N=29, E=16, K=4, G=4, TG=2, D=16, F=12),
)
VENDOR_MOE_SHAPE = MoEShape(N=64, E=256, K=8, G=1, TG=1, D=64, F=32)  # GLM-5's routing: 256 experts, top-8


def make_route_inputs(shape: MoEShape, *, dtype=torch.float32, device="cpu", seed: int = 0,
                      ties: Optional[str] = None) -> dict[str, torch.Tensor]:
    """logits [N, E] and bias [E]; ``ties='integer'`` gives few distinct logits (many exact score ties)."""
    s = shape
    if ties == "integer":
        logits = randint_like_scores((s.N, s.E), seed=seed, low=-1, high=2, dtype=dtype, device=device)
        bias = torch.zeros(s.E, device=device)
    else:
        logits = randn((s.N, s.E), seed=seed, dtype=dtype, device=device)
        bias = randn((s.E,), seed=seed + 1, dtype=torch.float32, device=device, scale=0.1)
    return {"logits": logits, "bias": bias}


def make_expert_inputs(shape: MoEShape, *, dtype=torch.float32, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    s = shape
    return {
        "x": randn((s.N, s.D), seed=seed, dtype=dtype, device=device),
        "w_gate": randn((s.E, s.F, s.D), seed=seed + 1, dtype=dtype, device=device, scale=s.D ** -0.5),
        "w_up": randn((s.E, s.F, s.D), seed=seed + 2, dtype=dtype, device=device, scale=s.D ** -0.5),
        "w_down": randn((s.E, s.D, s.F), seed=seed + 3, dtype=dtype, device=device, scale=s.F ** -0.5),
    }


# --------------------------------------------------------------------------------------------- KDA
@dataclasses.dataclass(frozen=True)
class KDAShape:
    """B batch, T tokens, H heads, K key / V value head dims, C chunk size, W conv width."""

    B: int
    T: int
    H: int
    K: int
    V: int
    C: int = 16
    W: int = 4

    def __str__(self) -> str:
        return f"B{self.B}T{self.T}H{self.H}K{self.K}V{self.V}C{self.C}"


# odd T (not a multiple of C), one token, T an exact multiple of C, a single partial chunk
KDA_SHAPES = (KDAShape(2, 37, 3, 16, 8), KDAShape(1, 1, 2, 8, 8), KDAShape(1, 32, 2, 32, 16), KDAShape(2, 5, 1, 8, 4))
KDA_LOWER_BOUND = -5.0  # GLM-5.3's linear_lower_bound: g = -5 sigmoid(.) in (-5, 0)


def make_kda_inputs(shape: KDAShape, *, dtype=torch.float32, device="cpu", seed: int = 0,
                    initial_state: bool = True) -> dict[str, torch.Tensor]:
    """q, k, v, g (in (KDA_LOWER_BOUND, 0)), beta (in (0, 1)) in ``dtype``, and an fp32 (fp64) initial state."""
    s = shape
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = {
        "q": randn((s.B, s.T, s.H, s.K), seed=seed, dtype=dtype, device=device),
        "k": randn((s.B, s.T, s.H, s.K), seed=seed + 1, dtype=dtype, device=device),
        "v": randn((s.B, s.T, s.H, s.V), seed=seed + 2, dtype=dtype, device=device),
        "g": (KDA_LOWER_BOUND * torch.sigmoid(randn((s.B, s.T, s.H, s.K), seed=seed + 3))).to(device, dtype),
        "beta": torch.sigmoid(randn((s.B, s.T, s.H), seed=seed + 4)).to(device, dtype),
    }
    if initial_state:
        x["initial_state"] = randn((s.B, s.H, s.K, s.V), seed=seed + 5, dtype=state_dtype, device=device, scale=0.5)
    return x


def make_conv_inputs(shape: KDAShape, *, dtype=torch.float32, device="cpu", seed: int = 0,
                     conv_state: bool = True) -> dict[str, torch.Tensor]:
    """x [B, T, D] (D = 3 H K, the layer's q, k, v channels), weight [D, W], and an fp32 (fp64) conv state."""
    s = shape
    D = 3 * s.H * s.K
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = {"x": randn((s.B, s.T, D), seed=seed, dtype=dtype, device=device),
         "weight": randn((D, s.W), seed=seed + 1, dtype=dtype, device=device, scale=s.W ** -0.5)}
    if conv_state:
        x["conv_state"] = randn((s.B, s.W - 1, D), seed=seed + 2, dtype=state_dtype, device=device)
    return x


# --------------------------------------------------------------------------------------------- Muon
MUON_SHAPES = ((7, 13), (13, 7), (3, 5, 9), (2, 16, 16), (1, 24))


def make_muon_input(shape: Sequence[int], *, dtype=torch.float32, device="cpu", seed: int = 0) -> torch.Tensor:
    return randn(shape, seed=seed, dtype=dtype, device=device)


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """Exact U V^T of each matrix (fp64 SVD)."""
    U, _, Vh = torch.linalg.svd(G.to(torch.float64), full_matrices=False)
    return U @ Vh


def orthogonality_error(X: torch.Tensor) -> float:
    """max_i |sigma_i(X) - 1| over every matrix of the batch."""
    return float((torch.linalg.svdvals(X.to(torch.float64)) - 1).abs().max())


# --------------------------------------------------------------------------------------------- comparators
@dataclasses.dataclass
class Comparison:
    passed: bool
    max_error: float
    allowed: float
    detail: str


def compare_to_fp64(out: torch.Tensor, ref_same_precision: torch.Tensor, ref_fp64: torch.Tensor,
                    dtype: torch.dtype) -> Comparison:
    """err(out) <= ERROR_FACTOR * err(reference at the same precision) + atol(dtype), elementwise maxima;
    ``out`` must also have the dtype and device of the same-precision reference run."""
    if out.shape != ref_fp64.shape:
        return Comparison(False, float("inf"), 0.0, f"shape {tuple(out.shape)} != reference {tuple(ref_fp64.shape)}")
    if (out.dtype, out.device) != (ref_same_precision.dtype, ref_same_precision.device):
        return Comparison(False, float("inf"), 0.0, f"dtype/device {out.dtype} on {out.device} != reference "
                                                    f"{ref_same_precision.dtype} on {ref_same_precision.device}")
    exact = ref_fp64.to(torch.float64).cpu()
    err = float((out.detach().to(torch.float64).cpu() - exact).abs().max()) if out.numel() else 0.0
    ref_err = float((ref_same_precision.detach().to(torch.float64).cpu() - exact).abs().max()) if out.numel() else 0.0
    atol, _ = TOLERANCES[dtype]
    magnitude = float(exact.abs().max()) if exact.numel() else 0.0
    allowed = ERROR_FACTOR * ref_err + atol * max(1.0, magnitude)
    if err != err:  # NaN
        return Comparison(False, err, allowed, "output contains NaN")
    return Comparison(err <= allowed, err, allowed,
                      f"max |out - fp64 ref| = {err:.3g}, allowed {allowed:.3g} (reference at {dtype}: {ref_err:.3g})")


def topk_sets_agree(idx: torch.Tensor, ref_idx: torch.Tensor, scores: torch.Tensor, rel_tol: float) -> Comparison:
    """Cross-backend rule: selected sets may differ only where scores are within tolerance of the k-th score.

    ``scores`` are the fp64 reference scores [B, T, S] (-inf where not visible)."""
    if idx.shape != ref_idx.shape or idx.dtype != torch.int32:
        return Comparison(False, float("inf"), 0.0,
                          f"got {tuple(idx.shape)} {idx.dtype}, want {tuple(ref_idx.shape)} int32")
    idx, ref_idx, scores = idx.cpu().long(), ref_idx.cpu().long(), scores.cpu().to(torch.float64)
    if not torch.equal(idx < 0, ref_idx < 0):
        return Comparison(False, float("inf"), 0.0, "-1 padding differs from the reference")
    worst = 0.0
    B, T, _ = idx.shape
    for b in range(B):
        for t in range(T):
            chosen = idx[b, t][idx[b, t] >= 0]
            if chosen.numel() != chosen.unique().numel():
                return Comparison(False, float("inf"), 0.0, f"row ({b},{t}): a key is selected twice")
            if chosen.numel() and int(chosen.max()) < scores.shape[-1]:
                row = scores[b, t, chosen]
                finite_row = row[torch.isfinite(row)]
                scale = max(float(finite_row.abs().max()) if finite_row.numel() else 0.0, 1e-30)
                drops = (row[1:] - row[:-1]) / scale  # must be <= 0 up to tolerance (descending order)
                if drops.numel() and float(drops.max()) > rel_tol:
                    return Comparison(False, float(drops.max()), rel_tol, f"row ({b},{t}): not sorted by score")
            mine = set(idx[b, t][idx[b, t] >= 0].tolist())
            theirs = set(ref_idx[b, t][ref_idx[b, t] >= 0].tolist())
            if mine == theirs:
                continue
            if not theirs:
                return Comparison(False, float("inf"), 0.0, f"row ({b},{t}): selected keys where none is visible")
            kth = float(scores[b, t, sorted(theirs, key=lambda s: float(scores[b, t, s]))[0]])
            scale = max(abs(kth), float(scores[b, t][torch.isfinite(scores[b, t])].abs().max()), 1e-30)
            for s in mine ^ theirs:
                if s >= scores.shape[-1] or not torch.isfinite(scores[b, t, s]):
                    return Comparison(False, float("inf"), 0.0, f"row ({b},{t}): key {s} is not visible")
                worst = max(worst, abs(float(scores[b, t, s]) - kth) / scale)
    return Comparison(worst <= rel_tol, worst, rel_tol,
                      f"largest relative score gap of a differing key to the k-th score: {worst:.3g}")
