#!/usr/bin/env bash
# On an Ascend NPU (torch_npu installed: pip install -e ".[ascend,bench]"): the ascend conformance suite, then the
# kernel benchmarks against the reference and the peers, rendered (benchmarks/run_device.sh ascend).
# Results go to $OUT when set (device runner), else benchmarks/results/ascend/.
exec "$(dirname "$0")/../run_device.sh" ascend
