#!/usr/bin/env bash
# On an H200 (or any NVIDIA GPU): benchmarks/run_device.sh cuda (the cuda conformance suite, then the kernel
# benchmarks against the reference and the peers, rendered), the kernel tests, then the cuda kernel benchmarks:
# first the kernels training runs (sparse MLA prefill forward / forward + backward on bf16 tensor cores, the
# grouped SwiGLU forward + backward, the sparse stage's indexer-KL target; TFLOP/s from the FLOP counts written out
# in cases.py), then the rest.
# Results go to $OUT when set (device runner), else benchmarks/results/. Time-boxed to finish in < 9.5 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
status=0
OUT="$RESULTS" GLM5_CONFORMANCE_TIMEOUT=150 GLM5_BENCH_TIMEOUT=30 GLM5_BENCH_FILES="bench_dsa bench_mla bench_moe bench_muon" \
  benchmarks/run_device.sh cuda || status=1
timeout 80 python -m pytest -q -p no:cacheprovider tests/backends/triton tests/backends/rocm > "$RESULTS/tests_cuda.txt" 2>&1 || status=1
tail -3 "$RESULTS/tests_cuda.txt"
TRAINING="sparse_prefill_forward_case sparse_prefill_case experts_backward_case attention_target_case"  # = cases.TRAINING_CASES
timeout 90 python benchmarks/gpu/bench_kernels.py --out "$RESULTS/training" --budget-s 60 --only $TRAINING \
  || status=1
timeout 100 python benchmarks/gpu/bench_kernels.py --out "$RESULTS" --budget-s 65 --skip $TRAINING || status=1
exit $status
