"""NoPE MLA (qk_rope_head_dim = 0, GLM-5.3's attention) cases shared by the reference and backend tests: every
MLA and sparse-MLA op on inputs with empty rope slices, and the check that a backend's kernel (not the
reference) ran and agrees with the reference, forward and backward."""
from __future__ import annotations

import torch

from glm5_core import registry
from glm5_core.ops import dsa, mla

B, T, S, H, Dn, Dv, C, K = 2, 5, 11, 3, 8, 6, 12, 4


def inputs(dtype: torch.dtype, device: str = "cpu", seed: int = 0, rope: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    x = dict(q_nope=r(B, T, H, Dn), c_kv=r(B, S, C), w_uk=r(H, Dn, C, scale=0.3), w_uv=r(H, Dv, C, scale=0.3))
    idx = torch.randint(0, S, (B, T, K), generator=g)
    x.update(q_pe=r(B, T, H, rope), k_pe=r(B, S, rope))  # drawn last: the other inputs do not depend on ``rope``
    idx[0, 1, 2:] = -1  # padding slots
    idx[1, 0] = -1  # a row with no key
    x["topk_idx"] = idx.to(torch.int32).to(device)
    return x


def _expanded(x):
    k_nope = torch.einsum("bsc,hdc->bshd", x["c_kv"], x["w_uk"])
    v = torch.einsum("bsc,hvc->bshv", x["c_kv"], x["w_uv"])
    return dict(q_nope=x["q_nope"], q_pe=x["q_pe"], k_nope=k_nope, k_pe=x["k_pe"], v=v, topk_idx=x["topk_idx"])


MLA = ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv")


def _mla(x):
    return {k: x[k] for k in MLA}

# op -> (entry point (backend, **inputs), reference (**inputs), which inputs)
OPS = {
    "mla_prefill": (lambda be, **t: mla.prefill(**t, scale=0.4, start_pos=S - T, backend=be),
                    lambda **t: mla.prefill_reference(**t, scale=0.4, start_pos=S - T), _mla),
    "mla_decode": (lambda be, **t: mla.decode(**t, scale=0.4, backend=be),
                   lambda **t: mla.decode_reference(**t, scale=0.4, start_pos=S - T), _mla),
    "dsa_sparse_prefill": (lambda be, **t: dsa.sparse_prefill(**t, scale=0.4, backend=be),
                           lambda **t: dsa.sparse_attention_reference(**t, scale=0.4), lambda x: x),
    "dsa_sparse_decode": (lambda be, **t: dsa.sparse_decode(**t, scale=0.4, backend=be),
                          lambda **t: dsa.sparse_attention_reference(**t, scale=0.4), lambda x: x),
    "dsa_sparse_prefill_expanded": (lambda be, **t: dsa.sparse_prefill_expanded(**t, scale=0.4, backend=be),
                                    lambda **t: dsa.sparse_prefill_expanded_reference(**t, scale=0.4), _expanded),
    "dsa_selected_attention_target": (
        lambda be, **t: dsa.selected_attention_target(**{k: v for k, v in t.items() if k != "w_uv"}, scale=0.4,
                                                      start_pos=S - T, backend=be),
        lambda **t: registry.reference("dsa_selected_attention_target")(
            *(t[k] for k in ("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "topk_idx")), scale=0.4, start_pos=S - T,
            k_nope=None, normaliser="selected"),
        lambda x: x),
}


def run(op: str, backend: str, dtype: torch.dtype, device: str):
    """(kernel outputs (out, grads), reference outputs, whether the kernel ran) with Dr = 0; gradients for the ops
    declared differentiable (the others run forward only, as a backend runs them)."""
    entry, ref, pick = OPS[op]
    grad = registry.op_spec(op).differentiable
    x = pick(inputs(dtype, device))

    def call(fn, **kw):
        leaves = {k: (v.detach().clone().requires_grad_(grad) if v.is_floating_point() else v) for k, v in x.items()}
        out = fn(**leaves, **kw)
        grads = {}
        if grad and out.requires_grad:
            out.float().square().sum().backward()
            grads = {k: v.grad for k, v in leaves.items() if v.is_floating_point() and v.grad is not None}
        return out, grads

    with registry.record_reference_runs() as log:
        got = call(entry, be=backend)
    want = call(ref)
    return got, want, not log
