#!/usr/bin/env bash
# On a machine with several NVIDIA GPUs: the expert-parallel exchange benchmark (benchmarks/gpu/bench_ep.py),
# DeepEP against the reference all_to_all over NCCL, one process per GPU under torchrun. GPUS=N picks the count
# (default: every visible GPU, at least 2); extra arguments go to bench_ep.py (e.g. --tokens 8192 --top-k 8).
# Results go to $OUT when set (device runner), else benchmarks/results/, as ep_gpu_<N>gpu.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
N="${GPUS:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
if ! [[ "$N" =~ ^[0-9]+$ ]] || [ "$N" -lt 2 ]; then
  echo "run_ep.sh: needs at least 2 GPUs (GPUS or the visible ones), got '$N'" >&2
  exit 2
fi
timeout 540 torchrun --standalone --nproc-per-node "$N" benchmarks/gpu/bench_ep.py \
  --out "$RESULTS/ep_gpu_${N}gpu.json" "$@"
