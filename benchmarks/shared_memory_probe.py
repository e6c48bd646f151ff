"""Compile every Triton kernel glm5-core launches, for gfx942 (MI300X) and sm_90 (H100 / H200), and compare the
shared memory the compiler allocates with ``glm5_core.backends.triton.shared_memory``'s estimate.

No GPU needed: Triton compiles ahead of time for a named target; this stops after its LLVM-IR stage, where the
shared-memory allocation (``ttg.shared``) is fixed, so neither ptxas nor a ROCm linker runs.

    python benchmarks/shared_memory_probe.py [--targets rocm,cuda] [--families sparse_mla,...] [--out FILE.md] [--check]

``--check``: exit 1 when a kernel compiles to more than its vendor's limit or than the estimate.

Uses Triton's compiler internals (``make_backend`` / ``add_stages``) as they are in triton 3.x.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch  # noqa: F401  (triton's AMD backend looks for torch)
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from glm5_core.backends.triton import (
    causal_lse,
    dsa_selected_attention_target,
    indexer,
    moe_experts,
    moe_experts_bwd,
    moe_permute,
    moe_route,
    newton_schulz,
    sparse_mla,
    table,
)
from glm5_core.backends.triton import shared_memory as smem
from glm5_core.backends.triton._util import next_pow2

TARGETS = {"rocm": GPUTarget("hip", "gfx942", 64), "cuda": GPUTarget("cuda", 90, 32)}
FLOAT_NAMES = {4: "fp32", 2: "bf16"}
SCALAR_FLOATS = {"scale", "alpha", "beta", "a_coef", "scaling"}


def compiled_shared_bytes(fn, target, constexprs, pointer_types, launch) -> int:
    """``ttg.shared`` of ``fn`` compiled for ``target``: pointers typed by ``pointer_types`` (name -> type, '*fp32'
    for the rest), scalars i32 (fp32 for the softmax scale and the Newton-Schulz coefficients)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*fp32")
        else:
            signature[name] = "fp32" if name in SCALAR_FLOATS else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    backend = make_backend(target)
    options = backend.parse_options({k: v for k, v in launch.items()})
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    metadata = {"target": target, **options.__dict__}
    for stage in ("ttir", "ttgir", "llir"):
        module = stages[stage](module, metadata)
    return int(metadata["shared"])


def launches(family: str, config, dims: smem.ModelDims, itemsize: int):
    """(estimate's kernel name, kernel fn, constexprs, pointer types) of every kernel of ``family``."""
    blocks = config.blocks
    fp = "*" + FLOAT_NAMES[itemsize]
    if family == "indexer":
        pads = dict(H=dims.indexer_heads, D=dims.indexer_head_dim, H_PAD=next_pow2(dims.indexer_heads, 16),
                    D_PAD=next_pow2(dims.indexer_head_dim, 16), BS=blocks["keys"], INTERPRETED=False)
        kp = next_pow2(dims.index_topk, blocks["keys"])
        ptrs = dict(q_ptr=fp, k_ptr=fp, start_ptr="*i32", out_ptr="*i32", scratch_ptr="*i64", nan_ptr="*i8")
        yield "indexer_topk", indexer._indexer_topk_kernel, dict(pads, KP=kp, POOL=1), ptrs
        yield "indexer_scores", indexer._indexer_scores_kernel, pads, dict(ptrs, out_ptr="*fp32")
    elif family == "sparse_mla":
        tc = itemsize == 2
        meta = dict(C=dims.latent, DR=dims.rope, BH=blocks["heads"], BK=blocks["keys"],
                    C_PAD=next_pow2(dims.latent, 16), DR_PAD=next_pow2(dims.rope, 16), TC=tc,
                    EMULATE=False)
        ptrs = {name: fp for name in ("qlat_ptr", "qpe_ptr", "ckv_ptr", "kpe_ptr", "dout_ptr")}
        ptrs["idx_ptr"] = "*i32"
        yield "sparse_fwd", sparse_mla._sparse_fwd_kernel, meta, ptrs
        yield "sparse_bwd_dq", sparse_mla._sparse_bwd_dq_kernel, meta, ptrs
        yield "sparse_bwd_dkv", sparse_mla._sparse_bwd_dkv_kernel, meta, ptrs
    elif family == "dsa_selected_attention_target":
        pads = dict(C=dims.latent, DR=dims.rope, C_PAD=next_pow2(dims.latent, 16), DR_PAD=next_pow2(dims.rope, 16))
        meta = dict(pads, BH=blocks["heads"], BK=blocks["keys"])
        ptrs = dict(ckv_ptr="*bf16", kpe_ptr="*bf16", idx_ptr="*i32", start_ptr="*i32")  # the keys as given
        yield "selected_lse", dsa_selected_attention_target._selected_lse_kernel, meta, ptrs
        yield "target", dsa_selected_attention_target._target_kernel, meta, ptrs
        yield "causal_lse", causal_lse._causal_lse_kernel, dict(pads, BM=blocks["rows"], BS=blocks["cols"]), ptrs
    elif family == "moe_experts":
        mnk = dict(BM=blocks["m"], BN=blocks["n"], BK=blocks["k"])
        tiles = dict(tile_expert_ptr="*i32", tile_row0_ptr="*i32", tile_row1_ptr="*i32")
        yield "grouped_gemm", moe_experts._grouped_gemm_kernel, dict(mnk, SWIGLU=True, CLAMP=True), tiles
        yield "swiglu_bwd", moe_experts_bwd._swiglu_bwd_kernel, dict(mnk, CLAMP=True), tiles
        yield "grouped_dx", moe_experts_bwd._grouped_dx_kernel, mnk, tiles
        yield "grouped_wgrad", moe_experts_bwd._grouped_wgrad_kernel, \
            dict(PAIR=True, BI=blocks["m"], BJ=blocks["n"], BR=blocks["k"]), \
            dict(row_start_ptr="*i64", counts_ptr="*i64")
    elif family == "newton_schulz":
        yield "symmetric", newton_schulz._symmetric_kernel, dict(HAS_Z=True, BM=blocks["m"], BK=blocks["k"]), {}
        yield "gemm", newton_schulz._gemm_kernel, dict(BM=blocks["m"], BN=blocks["n"], BK=blocks["k"]), {}
    elif family == "moe_route":
        E, K = dims.experts, dims.experts_per_token
        meta = dict(HAS_BIAS=True, SOFTMAX=False, RENORM=True, N_GROUP=1, PER_GROUP=E, TOPK_GROUP=1, TOP_K=K,
                    K_PAD=next_pow2(K), E_PAD=next_pow2(E), G_PAD=1, BN=blocks["tokens"])
        yield "route", moe_route._route_kernel, meta, dict(ids_ptr="*i32")
    elif family == "moe_permute":
        ids = dict(ids_ptr="*i32", counts_ptr="*i64", offsets_ptr="*i64", sort_idx_ptr="*i64")
        yield "count", moe_permute._count_kernel, dict(BR=blocks["rows"]), ids
        yield "place", moe_permute._place_kernel, dict(BR=blocks["rows"]), ids
        yield "gather_rows", moe_permute._gather_rows_kernel, dict(WEIGHTED=True, BR=16, BD=blocks["cols"]), \
            dict(ids, x_ptr=fp, out_ptr=fp)
        yield "combine", moe_permute._combine_kernel, dict(BD=blocks["cols"]), dict(inverse_ptr="*i64")
        yield "combine_weight_grad", moe_permute._combine_weight_grad_kernel, dict(BD=blocks["cols"]), \
            dict(inverse_ptr="*i64")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="rocm,cuda")
    parser.add_argument("--families", default=",".join(table.kernel_families()))
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--check", action="store_true", help="exit 1 if a launch is over its limit or the estimate")
    args = parser.parse_args(argv)
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.rocm.launch import ROCM_CONFIGS

    tables = {"rocm": ROCM_CONFIGS, "cuda": CUDA_CONFIGS}
    rows = ["| target | family | kernel | dtype | blocks, stages | compiled bytes | estimate | limit | fits |",
            "|---|---|---|---|---|---|---|---|---|"]
    worst, over_limit = 0, 0
    for vendor in args.targets.split(","):
        limit = tables[vendor].shared_memory_limit
        for family in args.families.split(","):
            config = table.launch_config(tables[vendor], family)
            estimates = smem.estimate(family, config)
            for itemsize in smem.itemsizes(family):
                for kernel, fn, constexprs, ptrs in launches(family, config, smem.GLM5_DIMS, itemsize):
                    start = time.time()
                    got = compiled_shared_bytes(fn, TARGETS[vendor], constexprs, ptrs, config.launch_kwargs())
                    est = estimates[(kernel, itemsize)]
                    worst = max(worst, got - est)
                    over_limit += got > limit or est > limit
                    row = (f"| {TARGETS[vendor].arch} | {family} | {kernel} | {FLOAT_NAMES[itemsize]} | "
                           f"{dict(config.blocks)}, {config.num_stages} | {got} | {est} | {limit} | "
                           f"{'yes' if got <= limit else 'NO'} |")
                    rows.append(row)
                    print(row, f"({time.time() - start:.0f} s)", flush=True)
    print(f"largest compiled - estimate: {worst} bytes ({'the estimate is an upper bound' if worst <= 0 else 'UNDER'})"
          f"; launches over their limit: {over_limit}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(rows) + "\n")
    return 1 if args.check and (worst > 0 or over_limit) else 0


if __name__ == "__main__":
    sys.exit(main())
