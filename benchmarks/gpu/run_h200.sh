#!/usr/bin/env bash
# On an H200 (or any NVIDIA GPU): the cuda conformance suite, the kernel tests, then the kernel benchmarks:
# first the kernels training runs (sparse MLA prefill forward / forward + backward on bf16 tensor cores, the
# grouped SwiGLU forward + backward, the sparse stage's indexer-KL target; TFLOP/s from the FLOP counts written out
# in cases.py), then the rest.
# Results go to $OUT when set (device runner), else benchmarks/results/. Time-boxed to finish in < 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
python -c "import glm5_core.backends.cuda" 2>/dev/null || pip install -q --no-deps --no-build-isolation -e . \
  > "$RESULTS/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$RESULTS/device.txt" 2>&1 || true
status=0
GLM5_TEST_BACKENDS=cuda timeout 180 python -m pytest -q -p no:cacheprovider tests/conformance \
  --junitxml="$RESULTS/conformance_cuda.xml" > "$RESULTS/conformance_cuda.txt" 2>&1 || status=1
tail -3 "$RESULTS/conformance_cuda.txt"
timeout 80 python -m pytest -q -p no:cacheprovider tests/backends/triton tests/backends/rocm > "$RESULTS/tests_cuda.txt" 2>&1 || status=1
tail -3 "$RESULTS/tests_cuda.txt"
TRAINING="sparse_prefill_forward_case sparse_prefill_case experts_backward_case attention_target_case"  # = cases.TRAINING_CASES
timeout 90 python benchmarks/gpu/bench_kernels.py --out "$RESULTS/training" --budget-s 60 --only $TRAINING \
  || status=1
timeout 130 python benchmarks/gpu/bench_kernels.py --out "$RESULTS" --budget-s 90 --skip $TRAINING || status=1
exit $status
