"""Compile every Triton kernel of the cuda backend ahead of time for a GPU target, without a GPU.

The interpreter checks what the kernels compute; this checks that the compiler accepts them (types of
loop-carried values, tensor shapes, constexpr use) down to the device binary. Run in a process where
``TRITON_INTERPRET`` is unset:  python tests/backends/triton/aot_compile.py cuda   (or: hip)
Prints one line per kernel, "OK name bf16_matrix_ops=N" (N: bf16 tensor-core instructions in its assembly,
mma / wgmma on NVIDIA, v_mfma on AMD) or "FAIL name error", and exits 1 if any failed.
"""
import re
import sys

I32, I64 = "i32", "i64"
TARGETS = {"cuda": ("cuda", 90, 32), "hip": ("hip", "gfx942", 64)}
ASSEMBLY = {"cuda": ("ptx", r"\b(?:wgmma\.mma_async|mma\.sync)\S*\.bf16"),  # (asm key, bf16 matrix instruction)
            "hip": ("amdgcn", r"\bv_mfma_f32_\w*bf16")}
# Compiler options as the launch tables pass them (AMD: 64-lane wavefronts, AMD-only knobs).
OPTIONS = {"cuda": {"num_warps": 4, "num_stages": 2},
           "hip": {"num_warps": 8, "num_stages": 2, "waves_per_eu": 2, "matrix_instr_nonkdim": 16}}


def _sig(pointers, scalars, constexprs):
    sig = dict(pointers)
    sig.update({name: kind for name, kind in scalars})
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def kernels():
    """(name, jit function, signature, constexpr values), at small but representative sizes."""
    from glm5_core.backends.triton import (
        causal_lse,
        dsa_selected_attention_target,
        indexer,
        kda,
        kda_bwd,
        moe_experts,
        moe_experts_bwd,
        moe_permute,
        moe_route,
        newton_schulz,
        sparse_mla,
    )

    idx_strides = [(n, I32) for n in ("stride_qb", "stride_qt", "stride_qh", "stride_qd", "stride_kb", "stride_ks",
                                      "stride_kd", "stride_wb", "stride_wt", "stride_wh")]
    pads = dict(H=4, D=24, H_PAD=16, D_PAD=32, BS=64, INTERPRETED=False)
    yield ("indexer_topk", indexer._indexer_topk_kernel,
           _sig({"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "start_ptr": "*i32", "out_ptr": "*i32",
                 "scratch_ptr": "*i64", "nan_ptr": "*i8"}, [("T", I32), ("S", I32), ("K", I32)] + idx_strides,
                list(pads) + ["KP", "POOL"]),
           dict(pads, KP=128, POOL=16))  # POOL: the k-pool indexer's pool size (1: every key a pool)
    yield ("indexer_scores", indexer._indexer_scores_kernel,
           _sig({"q_ptr": "*fp32", "k_ptr": "*fp32", "w_ptr": "*fp32", "start_ptr": "*i32", "out_ptr": "*fp32"},
                [("T", I32), ("S", I32)] + idx_strides, list(pads)), pads)
    key_strides = [(n, I32) for n in ("stride_cb", "stride_cs", "stride_kb", "stride_ks", "stride_ir")]
    for tensor_cores in (False, True):  # exact fp32 products / bf16 tensor cores (bf16 operands)
        mla_meta = dict(C=24, DR=8, BH=16, BK=32, C_PAD=32, DR_PAD=16, TC=tensor_cores, EMULATE=False)
        q_type, key_type, tag = ("*bf16", "*bf16", "_bf16_tensor_cores") if tensor_cores else ("*fp32", "*fp32", "")
        common = {"qlat_ptr": q_type, "qpe_ptr": q_type, "ckv_ptr": key_type, "kpe_ptr": key_type, "idx_ptr": "*i32"}
        yield (f"sparse_fwd{tag}", sparse_mla._sparse_fwd_kernel,
               _sig(dict(common, ckv_ptr="*bf16", kpe_ptr="*bf16", out_ptr="*fp32", lse_ptr="*fp32"),
                    [("T", I32), ("H", I32), ("K", I32), ("scale", "fp32")] + key_strides, list(mla_meta)), mla_meta)
        bwd_ptrs = dict(common, dout_ptr=q_type, lse_ptr="*fp32", delta_ptr="*fp32")
        yield (f"sparse_bwd_dq{tag}", sparse_mla._sparse_bwd_dq_kernel,
               _sig(dict(bwd_ptrs, dqlat_ptr="*fp32", dqpe_ptr="*fp32"),
                    [("T", I32), ("H", I32), ("K", I32), ("scale", "fp32")] + key_strides, list(mla_meta)), mla_meta)
        yield (f"sparse_bwd_dkv{tag}", sparse_mla._sparse_bwd_dkv_kernel,
               _sig(dict(bwd_ptrs, dkv_slots_ptr="*fp32", dkr_slots_ptr="*fp32"),
                    [("row0", I32), ("T", I32), ("H", I32), ("K", I32), ("scale", "fp32")] + key_strides,
                    list(mla_meta)), mla_meta)
    target_meta = dict(C=24, DR=8, BH=16, BK=32, C_PAD=32, DR_PAD=16)
    target_ptrs = {"qlat_ptr": "*fp32", "qpe_ptr": "*fp32", "ckv_ptr": "*bf16", "kpe_ptr": "*bf16", "idx_ptr": "*i32",
                   "lse_ptr": "*fp32"}
    target_scalars = [("T", I32), ("H", I32), ("K", I32), ("scale", "fp32")] + key_strides
    yield ("target_selected_lse", dsa_selected_attention_target._selected_lse_kernel,
           _sig(target_ptrs, target_scalars, list(target_meta)), target_meta)
    yield ("target", dsa_selected_attention_target._target_kernel,
           _sig(dict(target_ptrs, out_ptr="*fp32"), target_scalars, list(target_meta)), target_meta)
    lse_meta = dict(C=24, DR=8, BM=32, BS=32, C_PAD=32, DR_PAD=16)
    yield ("target_causal_lse", causal_lse._causal_lse_kernel,
           _sig({"qlat_ptr": "*fp32", "qpe_ptr": "*fp32", "ckv_ptr": "*bf16", "kpe_ptr": "*bf16", "start_ptr": "*i32",
                 "lse_ptr": "*fp32"}, [("T", I32), ("H", I32), ("S", I32), ("scale", "fp32")] + key_strides[:4],
                list(lse_meta)), lse_meta)
    route_meta = dict(HAS_BIAS=True, SOFTMAX=False, RENORM=True, N_GROUP=8, PER_GROUP=32, TOPK_GROUP=4, TOP_K=8,
                      K_PAD=8, E_PAD=256, G_PAD=8, BN=16)
    yield ("moe_route", moe_route._route_kernel,
           _sig({"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"},
                [("N", I32), ("E", I32), ("stride_n", I32), ("scaling", "fp32")], list(route_meta)), route_meta)
    yield ("moe_count", moe_permute._count_kernel,
           _sig({"ids_ptr": "*i32", "counts_ptr": "*i64"}, [("M", I32)], ["BR"]), dict(BR=256))
    yield ("moe_place", moe_permute._place_kernel,
           _sig({"ids_ptr": "*i32", "offsets_ptr": "*i64", "sort_idx_ptr": "*i64"}, [("M", I32)], ["BR"]), dict(BR=256))
    for weighted in (False, True):  # dispatch / the combine's backward
        yield (f"moe_gather{'_weighted' if weighted else ''}", moe_permute._gather_rows_kernel,
               _sig({"x_ptr": "*bf16", "sort_idx_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16"},
                    [("M", I32), ("D", I32), ("K", I32), ("stride_x", I32)], ["WEIGHTED", "BR", "BD"]),
               dict(WEIGHTED=weighted, BR=16, BD=128))
    yield ("moe_combine_weight_grad", moe_permute._combine_weight_grad_kernel,
           _sig({"y_ptr": "*bf16", "inverse_ptr": "*i64", "dout_ptr": "*bf16", "dw_ptr": "*fp32"},
                [("D", I32), ("K", I32)], ["BD"]), dict(BD=128))
    yield ("moe_combine", moe_permute._combine_kernel,
           _sig({"y_ptr": "*bf16", "inverse_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16"},
                [("D", I32), ("K", I32)], ["BD"]), dict(BD=128))
    gemm_meta = dict(SWIGLU=True, CLAMP=True, BM=64, BN=64, BK=32)  # CLAMP: GLM-5.3's swiglu_limit
    yield ("grouped_gemm", moe_experts._grouped_gemm_kernel,
           _sig({"a_ptr": "*bf16", "b1_ptr": "*bf16", "b2_ptr": "*bf16", "out_ptr": "*fp32", "tile_expert_ptr": "*i32",
                 "tile_row0_ptr": "*i32", "tile_row1_ptr": "*i32"},
                [("NOUT", I32), ("KDIM", I32), ("stride_am", I32), ("stride_be", I32), ("stride_bn", I32),
                 ("stride_om", I32), ("limit", "fp32")], list(gemm_meta)), gemm_meta)
    tiles = {"tile_expert_ptr": "*i32", "tile_row0_ptr": "*i32", "tile_row1_ptr": "*i32"}
    yield ("swiglu_bwd", moe_experts_bwd._swiglu_bwd_kernel,
           _sig(dict({"x_ptr": "*bf16", "dout_ptr": "*bf16", "wg_ptr": "*bf16", "wu_ptr": "*bf16", "wd_ptr": "*bf16",
                      "h_ptr": "*fp32", "dg_ptr": "*fp32", "du_ptr": "*fp32"}, **tiles),
                [("F", I32), ("D", I32), ("limit", "fp32")], ["CLAMP", "BM", "BN", "BK"]),
           dict(CLAMP=True, BM=64, BN=64, BK=32))
    yield ("grouped_dx", moe_experts_bwd._grouped_dx_kernel,
           _sig(dict({"dg_ptr": "*fp32", "du_ptr": "*fp32", "wg_ptr": "*bf16", "wu_ptr": "*bf16", "dx_ptr": "*fp32"},
                     **tiles), [("F", I32), ("D", I32)], ["BM", "BN", "BK"]), dict(BM=64, BN=64, BK=32))
    yield ("grouped_wgrad", moe_experts_bwd._grouped_wgrad_kernel,
           _sig({"a1_ptr": "*fp32", "a2_ptr": "*fp32", "b_ptr": "*bf16", "out1_ptr": "*fp32", "out2_ptr": "*fp32",
                 "row_start_ptr": "*i64", "counts_ptr": "*i64"}, [("I", I32), ("J", I32)], ["PAIR", "BI", "BJ", "BR"]),
           dict(PAIR=True, BI=64, BJ=64, BR=32))
    for suffix, dtype, bf16 in (("", "*fp32", False), ("_bf16", "*bf16", True)):  # fp32 / bf16 compute
        ns_meta = dict(BF16=bf16, EMULATE=False)
        yield ("ns_symmetric" + suffix, newton_schulz._symmetric_kernel,
               _sig({"y_ptr": dtype, "z_ptr": dtype, "out_ptr": dtype},
                    [("R", I32), ("KDIM", I32), ("alpha", "fp32"), ("beta", "fp32")],
                    ["HAS_Z", "BM", "BK", "BF16", "EMULATE"]), dict(HAS_Z=True, BM=64, BK=32, **ns_meta))
        yield ("ns_gemm" + suffix, newton_schulz._gemm_kernel,
               _sig({"b_ptr": dtype, "x_ptr": dtype, "out_ptr": dtype}, [("R", I32), ("N", I32), ("a_coef", "fp32")],
                    ["BM", "BN", "BK", "BF16", "EMULATE"]), dict(BM=64, BN=64, BK=32, **ns_meta))
    yield ("kda_recurrent", kda._recurrent_kernel,
           _sig({"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
                 "s0_ptr": "*fp32", "o_ptr": "*bf16", "sT_ptr": "*fp32"},
                [("T", I32), ("H", I32), ("K", I32), ("V", I32), ("scale", "fp32"), ("eps", "fp32")],
                ["HAS_S0", "STORE_S", "L2NORM", "BK", "BV"]),
           dict(HAS_S0=True, STORE_S=True, L2NORM=True, BK=128, BV=32))
    yield ("kda_causal_conv", kda._conv_kernel,
           _sig({"x_ptr": "*bf16", "w_ptr": "*fp32", "b_ptr": "*bf16", "s_ptr": "*fp32", "o_ptr": "*bf16"},
                [("T", I32), ("D", I32)], ["HAS_BIAS", "HAS_STATE", "SILU", "W", "BT", "BD"]),
           dict(HAS_BIAS=False, HAS_STATE=True, SILU=True, W=4, BT=16, BD=64))
    yield ("kda_recurrent_bwd", kda_bwd._recurrent_bwd_kernel,
           _sig({"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
                 "s0_ptr": "*fp32", "do_ptr": "*bf16", "dsT_ptr": "*fp32", "ckpt_ptr": "*fp32", "seg_ptr": "*fp32",
                 "dq_ptr": "*fp32", "dk_ptr": "*fp32", "dg_ptr": "*fp32", "dbeta_ptr": "*fp32", "dv_ptr": "*bf16",
                 "ds0_ptr": "*fp32"},
                [("bh0", I32), ("NBH", I32), ("T", I32), ("H", I32), ("K", I32), ("V", I32), ("NV", I32),
                 ("NCK", I32), ("scale", "fp32"), ("eps", "fp32")], ["HAS_S0", "HAS_DST", "L2NORM", "BK", "BV", "CK"]),
           dict(HAS_S0=True, HAS_DST=True, L2NORM=True, BK=128, BV=16, CK=32))
    yield ("kda_recurrent_bwd_reduce", kda_bwd._recurrent_bwd_reduce_kernel,
           _sig({"q_ptr": "*bf16", "k_ptr": "*bf16", "dq_part_ptr": "*fp32", "dk_part_ptr": "*fp32",
                 "dg_part_ptr": "*fp32", "dbeta_part_ptr": "*fp32", "dq_ptr": "*bf16", "dk_ptr": "*bf16",
                 "dg_ptr": "*fp32", "dbeta_ptr": "*bf16"},
                [("bh0", I32), ("NBH", I32), ("T", I32), ("H", I32), ("K", I32), ("NV", I32), ("scale", "fp32"),
                 ("eps", "fp32")], ["L2NORM", "BR", "BK"]),
           dict(L2NORM=True, BR=8, BK=128))
    conv_bwd_meta = dict(HAS_BIAS=True, HAS_STATE=True, SILU=True, W=4, BT=16, BD=64)
    yield ("kda_conv_bwd_dz", kda_bwd._conv_bwd_dz_kernel,
           _sig({"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "s_ptr": "*fp32", "do_ptr": "*bf16",
                 "dz_ptr": "*fp32", "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32"},
                [("T", I32), ("D", I32), ("NT", I32)], list(conv_bwd_meta)), conv_bwd_meta)
    yield ("kda_conv_bwd_dx", kda_bwd._conv_bwd_dx_kernel,
           _sig({"dz_ptr": "*fp32", "w_ptr": "*bf16", "dx_ptr": "*bf16", "ds_ptr": "*fp32"}, [("T", I32), ("D", I32)],
                ["HAS_STATE", "W", "BT", "BD"]), dict(HAS_STATE=True, W=4, BT=16, BD=64))


def main(vendor: str) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(*TARGETS[vendor])
    failed = 0
    for name, fn, signature, constexprs in kernels():
        try:
            binary = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                    options=OPTIONS[vendor])
            asm_key, matrix_op = ASSEMBLY[vendor]
            print(f"OK {name} bf16_matrix_ops={len(re.findall(matrix_op, binary.asm[asm_key]))}", flush=True)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name} {exc!r}"[:4000], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
