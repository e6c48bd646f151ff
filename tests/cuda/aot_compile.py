"""Compile every Triton kernel of the cuda backend ahead of time for a GPU target, without a GPU.

The interpreter checks what the kernels compute; this checks that the compiler accepts them (types of
loop-carried values, tensor shapes, constexpr use) down to the device binary. Run in a process where
``TRITON_INTERPRET`` is unset:  python tests/cuda/aot_compile.py cuda   (or: hip)
Prints one line per kernel, "OK name" or "FAIL name error", and exits 1 if any failed.
"""
import sys

I32, I64 = "i32", "i64"
TARGETS = {"cuda": ("cuda", 90, 32), "hip": ("hip", "gfx942", 64)}
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
    from glm5_core.backends.triton import indexer, moe_experts, moe_permute, moe_route, newton_schulz, sparse_mla

    idx_strides = [(n, I32) for n in ("stride_qb", "stride_qt", "stride_qh", "stride_qd", "stride_kb", "stride_ks",
                                      "stride_kd", "stride_wb", "stride_wt", "stride_wh")]
    pads = dict(H=4, D=24, H_PAD=16, D_PAD=32, BS=64, WIDEN=False)
    yield ("indexer_topk", indexer._indexer_topk_kernel,
           _sig({"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "start_ptr": "*i32", "out_ptr": "*i32",
                 "scratch_ptr": "*i64", "nan_ptr": "*i8"}, [("T", I32), ("S", I32), ("K", I32)] + idx_strides,
                list(pads) + ["KP"]),
           dict(pads, KP=128))
    yield ("indexer_scores", indexer._indexer_scores_kernel,
           _sig({"q_ptr": "*fp32", "k_ptr": "*fp32", "w_ptr": "*fp32", "start_ptr": "*i32", "out_ptr": "*fp32"},
                [("T", I32), ("S", I32)] + idx_strides, list(pads)), pads)
    mla_meta = dict(C=24, DR=8, BH=16, BK=32, C_PAD=32, DR_PAD=16)
    key_strides = [(n, I32) for n in ("stride_cb", "stride_cs", "stride_kb", "stride_ks", "stride_ir")]
    common = {"qlat_ptr": "*fp32", "qpe_ptr": "*fp32", "ckv_ptr": "*bf16", "kpe_ptr": "*bf16", "idx_ptr": "*i32"}
    yield ("sparse_fwd", sparse_mla._sparse_fwd_kernel,
           _sig(dict(common, out_ptr="*fp32", lse_ptr="*fp32"),
                [("T", I32), ("H", I32), ("K", I32), ("scale", "fp32")] + key_strides, list(mla_meta)), mla_meta)
    bwd_ptrs = dict(common, ckv_ptr="*fp32", kpe_ptr="*fp32", dout_ptr="*fp32", lse_ptr="*fp32", delta_ptr="*fp32")
    yield ("sparse_bwd_dq", sparse_mla._sparse_bwd_dq_kernel,
           _sig(dict(bwd_ptrs, dqlat_ptr="*fp32", dqpe_ptr="*fp32"),
                [("T", I32), ("H", I32), ("K", I32), ("scale", "fp32")] + key_strides, list(mla_meta)), mla_meta)
    yield ("sparse_bwd_dkv", sparse_mla._sparse_bwd_dkv_kernel,
           _sig(dict(bwd_ptrs, dkv_slots_ptr="*fp32", dkr_slots_ptr="*fp32"),
                [("row0", I32), ("T", I32), ("H", I32), ("K", I32), ("scale", "fp32")] + key_strides, list(mla_meta)),
           mla_meta)
    route_meta = dict(HAS_BIAS=True, SOFTMAX=False, RENORM=True, N_GROUP=8, PER_GROUP=32, TOPK_GROUP=4, TOP_K=8,
                      K_PAD=8, E_PAD=256, G_PAD=8, BN=16)
    yield ("moe_route", moe_route._route_kernel,
           _sig({"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"},
                [("N", I32), ("E", I32), ("stride_n", I32), ("scaling", "fp32")], list(route_meta)), route_meta)
    yield ("moe_count", moe_permute._count_kernel,
           _sig({"ids_ptr": "*i32", "counts_ptr": "*i64"}, [("M", I32)], ["BR"]), dict(BR=256))
    yield ("moe_place", moe_permute._place_kernel,
           _sig({"ids_ptr": "*i32", "offsets_ptr": "*i64", "sort_idx_ptr": "*i64"}, [("M", I32)], ["BR"]), dict(BR=256))
    yield ("moe_gather", moe_permute._gather_rows_kernel,
           _sig({"x_ptr": "*bf16", "sort_idx_ptr": "*i64", "out_ptr": "*bf16"},
                [("M", I32), ("D", I32), ("K", I32), ("stride_x", I32)], ["BR", "BD"]), dict(BR=16, BD=128))
    yield ("moe_combine", moe_permute._combine_kernel,
           _sig({"y_ptr": "*bf16", "inverse_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16"},
                [("D", I32), ("K", I32)], ["BD"]), dict(BD=128))
    gemm_meta = dict(SWIGLU=True, BM=64, BN=64, BK=32)
    yield ("grouped_gemm", moe_experts._grouped_gemm_kernel,
           _sig({"a_ptr": "*bf16", "b1_ptr": "*bf16", "b2_ptr": "*bf16", "out_ptr": "*fp32", "tile_expert_ptr": "*i32",
                 "tile_row0_ptr": "*i32", "tile_row1_ptr": "*i32"},
                [("NOUT", I32), ("KDIM", I32), ("stride_am", I32), ("stride_be", I32), ("stride_bn", I32),
                 ("stride_om", I32)], list(gemm_meta)), gemm_meta)
    yield ("ns_symmetric", newton_schulz._symmetric_kernel,
           _sig({"y_ptr": "*fp32", "z_ptr": "*fp32", "out_ptr": "*fp32"},
                [("R", I32), ("KDIM", I32), ("alpha", "fp32"), ("beta", "fp32")], ["HAS_Z", "BM", "BK"]),
           dict(HAS_Z=True, BM=64, BK=32))
    yield ("ns_gemm", newton_schulz._gemm_kernel,
           _sig({"b_ptr": "*fp32", "x_ptr": "*fp32", "out_ptr": "*fp32"}, [("R", I32), ("N", I32), ("a_coef", "fp32")],
                ["BM", "BN", "BK"]), dict(BM=64, BN=64, BK=32))


def main(vendor: str) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(*TARGETS[vendor])
    failed = 0
    for name, fn, signature, constexprs in kernels():
        try:
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                           options=OPTIONS[vendor])
            print(f"OK {name}", flush=True)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name} {exc!r}"[:4000], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
