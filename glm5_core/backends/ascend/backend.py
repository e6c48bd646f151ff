"""Declaration of the ``ascend`` backend. Import-light: torch_npu is imported by the probe
(``glm5_core.backends.ascend.device.npu_probe``) and, for the operators, on the first kernel call; the kernel
modules are imported by ``kernel_table`` only once the backend is available."""

from glm5_core.backends.ascend.device import DEVICE, npu_probe
from glm5_core.registry import Backend, Kernel

MISSING = {
    "mla_prefill": "no vendor op mapped for the expanded, differentiable prefill; the reference runs as torch ops "
                   "on the NPU",
    "dsa_indexer_scores": "npu_lightning_indexer returns positions, not the score matrix; the reference runs on "
                          "the NPU",
    "muon_orthogonalize": "Newton-Schulz is batched matmuls that torch_npu already runs on the cube units: the "
                          "reference (one batched chain over the leading dims) runs on npu tensors; no fused vendor "
                          "op. With bf16 compute that reference still multiplies in fp32 (bf16-rounded values, "
                          "the spec), so it is no faster there",
    "dsa_sparse_prefill_expanded": "no vendor op mapped for the expanded (per-head keys) sparse prefill yet; the "
                                   "reference runs as torch ops on the NPU (dsa_sparse_prefill is the vendor's)",
    "dsa_selected_index_scores": "npu_lightning_indexer returns positions, not the scores at given keys; the "
                                 "reference (gathers over the K selected keys) runs on the NPU",
    "dsa_selected_attention_target": "no vendor op returns attention probabilities at given keys; the reference "
                                     "(query blocks of dense scores, no [T, S] tensor) runs on the NPU",
    "kda_recurrent": "torch_npu's npu_recurrent_gated_delta_rule (op-plugin; per-key decay gk, i.e. KDA's recurrence) "
                     "takes and updates the state in bf16 in place, and the KDA contract keeps it in fp32: the "
                     "reference runs as torch ops on the NPU",
    "kda_chunked": "CANN's aclnnChunkGatedDeltaRule (the chunked gated delta rule) takes one scalar gate g per head "
                   "and token, not KDA's per-channel gate, in bf16, with no backward: the differentiable reference "
                   "runs as torch ops on the NPU",
    "kda_causal_conv": "no vendor op mapped for the short causal depthwise conv with its state; the reference (W "
                       "multiply-adds per element) runs on the NPU",
    "kda_causal_conv_update": "no vendor op mapped for the conv's decode step; the reference runs on the NPU",
    "dsa_kpool_topk": "torch_npu's npu_lightning_indexer scores single keys with its own causal rule, not "
                      "softmax-pooled groups of index_kpool keys with a tail; the reference (elementwise pooling, "
                      "a padded GEMM and a stable sort) runs on the NPU",
    "mhc_sinkhorn": "no torch_npu op for Sinkhorn normalisation (and Triton-Ascend kernels are not wired in); the "
                    "reference runs as elementwise torch ops on the NPU",
    "mhc_mix": "no torch_npu op for the hyper-connection stream mix; the reference (a broadcast product and a "
               "batched [N, N] x [N, D] matmul) runs on the NPU",
}


def kernel_table() -> dict[str, Kernel]:
    from glm5_core.backends.ascend import dsa, ep, ep_mc2, mla, moe

    return {**dsa.KERNELS, **ep.KERNELS, **ep_mc2.KERNELS, **mla.KERNELS, **moe.KERNELS}


BACKEND = Backend(
    name="ascend",
    facts=DEVICE,
    probe=npu_probe,
    kernel_table=kernel_table,
    missing=MISSING,
    description="Huawei Ascend NPUs: torch_npu operators (lightning indexer, sparse flash attention, "
                "fused infer attention, MoE gating / routing / grouped matmul, MC2 expert-parallel dispatch / "
                "combine for rollout decode, MC2 all-to-all + grouped matmul for the fused experts in rollout)",
    detect=lambda: npu_probe()[0],
    priority=30,
)
