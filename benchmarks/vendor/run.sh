#!/usr/bin/env bash
# One vendor's kit, like benchmarks/gpu/run_h200.sh: the conformance suite, the vendor's tests, then the kernel
# benchmarks (FLOP counts from benchmarks/gpu/cases.py), results in one folder.
#   benchmarks/vendor/run.sh <vendor>              on the vendor's hardware
#   benchmarks/vendor/run.sh <vendor> --simulate   here, on the vendor's simulated device (results say SIMULATED)
# Results go to $OUT when set, else benchmarks/results/vendor-<vendor>[-simulated]/.
set -uo pipefail
cd "$(dirname "$0")/../.."
VENDOR="${1:?usage: benchmarks/vendor/run.sh <vendor> [--simulate]}"
SIM="${2:-}"
if [ -n "$SIM" ] && [ "$SIM" != "--simulate" ]; then echo "run.sh: expected --simulate or nothing, got $SIM" >&2; exit 2; fi
TAG="$VENDOR${SIM:+-simulated}"
RESULTS="${OUT:-benchmarks/results/vendor-$TAG}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$SIM" ]; then export TRITON_INTERPRET=1; fi  # before Python starts: the kernels are interpreted
python -m glm5_core.cli backends --json > "$RESULTS/backends.json" 2>&1
status=0
{ echo "vendor: $VENDOR ${SIM:+(SIMULATED: the documented surface of the vendor stack on this host, kernels on CPU tensors)}"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo "${GLM5_COMMIT:-unknown (not a git checkout)}")"; date -u; } > "$RESULTS/README.txt"
start=$(date +%s)
python -m glm5_core.cli conformance --backend "$VENDOR" $SIM --out "$RESULTS" > "$RESULTS/conformance.txt" 2>&1 \
  || status=1
echo "conformance: $(( $(date +%s) - start )) s" >> "$RESULTS/README.txt"
tail -3 "$RESULTS/conformance.txt"
GLM5_VENDOR_UNDER_TEST="$VENDOR" python -m pytest -q -p no:cacheprovider tests/backends/vendors \
  > "$RESULTS/tests.txt" 2>&1 || status=1
tail -1 "$RESULTS/tests.txt"
# interpreted, every case takes seconds to minutes on a shared host: a budget that lets all of them start
BUDGET_S=120; if [ -n "$SIM" ]; then BUDGET_S=900; fi
python benchmarks/vendor/simulated_bench.py "$VENDOR" $SIM --out "$RESULTS" --budget-s "$BUDGET_S" \
  > "$RESULTS/bench.txt" 2>&1 || status=1
tail -1 "$RESULTS/bench.txt"
exit $status
