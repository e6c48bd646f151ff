"""Every Triton kernel compiles ahead of time to an NVIDIA (sm_90) and an AMD (gfx942) binary, with no GPU:
the compiler's checks that the interpreter skips. Runs ``aot_compile.py`` in a fresh process without
``TRITON_INTERPRET`` (the interpreter and the compiler cannot share one process)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "aot_compile.py"


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_kernels_compile_for_the_gpu_target(vendor):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), vendor], capture_output=True, text=True, env=env,
                          timeout=900, cwd=SCRIPT.parents[3])
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("OK", "FAIL"))]
    assert proc.returncode == 0 and len(lines) == 32, proc.stdout[-4000:] + proc.stderr[-3000:]
    matrix_ops = {line.split()[1]: int(line.split("bf16_matrix_ops=")[1]) for line in lines}
    for name in ("sparse_fwd", "sparse_bwd_dq", "sparse_bwd_dkv"):  # bf16 inputs: bf16 tensor cores; fp32: none
        assert matrix_ops[f"{name}_bf16_tensor_cores"] > 0, (name, proc.stdout)
        assert matrix_ops[name] == 0, (name, proc.stdout)
