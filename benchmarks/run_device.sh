#!/usr/bin/env bash
# One command for a device run of one backend: `benchmarks/run_device.sh <backend>` (cuda, rocm, ascend, cpu or
# an out-of-tree backend's name). From the repository root, time-boxed:
#   1. the backend's conformance suite (GLM5_TEST_BACKENDS=<backend> pytest tests/conformance),
#   2. the kernel benchmarks, the backend against the reference and the peers on the same inputs
#      (pytest benchmarks --backends <backend>,reference), one pytest-benchmark JSON per file,
#   3. benchmarks/render.py over those files: bench_<backend>.md (tables, speed-ups over the reference) and .png.
# Results go to $OUT when set (device runner), else benchmarks/results/<backend>/. Time limits (seconds):
# GLM5_CONFORMANCE_TIMEOUT (180), GLM5_BENCH_TIMEOUT per benchmark file (120); GLM5_BENCH_FILES picks the files
# (default: bench_dsa bench_mla bench_moe bench_muon bench_train). Exit status 0 only if all ran.
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: benchmarks/run_device.sh <backend>   (e.g. cuda, rocm, ascend; 'glm5 backends' lists them)" >&2
  exit 2
fi
BACKEND="$1"
cd "$(dirname "$0")/.."
RESULTS="${OUT:-benchmarks/results/$BACKEND}"
mkdir -p "$RESULTS"
python -c "import glm5_core, pytest_benchmark" 2>/dev/null || pip install -q --no-build-isolation -e ".[bench]" \
  > "$RESULTS/install.log" 2>&1 || pip install -q --no-deps --no-build-isolation -e . >> "$RESULTS/install.log" 2>&1
python -c "
import sys
from glm5_core import registry
known = registry.backends()
if sys.argv[1] not in known:
    sys.exit(f'run_device.sh: expected one of {\", \".join(known)}, got {sys.argv[1]!r}')
import os
ok, why = known[sys.argv[1]].available()
if not ok and os.environ.get('TRITON_INTERPRET') != '1':  # no device: nothing would be measured
    sys.exit(f'run_device.sh: {sys.argv[1]} is not available here: {why}')
print(f'{sys.argv[1]}: ' + ('available' if ok else f'NOT available: {why}'))
" "$BACKEND" | tee "$RESULTS/device.txt" || exit 2
case "$BACKEND" in
  cuda) nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >> "$RESULTS/device.txt" 2>&1 ;;
  rocm) rocm-smi --showproductname >> "$RESULTS/device.txt" 2>&1 ;;
  ascend) npu-smi info >> "$RESULTS/device.txt" 2>&1 ;;
esac
status=0
GLM5_TEST_BACKENDS="$BACKEND" timeout "${GLM5_CONFORMANCE_TIMEOUT:-180}" python -m pytest -q -p no:cacheprovider \
  tests/conformance --junitxml="$RESULTS/conformance_$BACKEND.xml" > "$RESULTS/conformance_$BACKEND.txt" 2>&1 || status=1
tail -3 "$RESULTS/conformance_$BACKEND.txt"
jsons=()
for file in ${GLM5_BENCH_FILES:-bench_dsa bench_mla bench_moe bench_muon bench_train}; do
  timeout "${GLM5_BENCH_TIMEOUT:-120}" python -m pytest -q -rs benchmarks/$file.py --backends "$BACKEND,reference" \
    --benchmark-json "$RESULTS/${file}_$BACKEND.json" > "$RESULTS/${file}_$BACKEND.txt" 2>&1 || status=1
  tail -1 "$RESULTS/${file}_$BACKEND.txt"
  [ -s "$RESULTS/${file}_$BACKEND.json" ] && jsons+=("$RESULTS/${file}_$BACKEND.json")
done
if [ ${#jsons[@]} -gt 0 ]; then
  python benchmarks/render.py "${jsons[@]}" --out "$RESULTS/bench_$BACKEND" > /dev/null || status=1
  echo "speed-ups over the reference: $RESULTS/bench_$BACKEND.md (plot: bench_$BACKEND.png)"
else
  status=1
fi
exit $status
