"""When this folder cannot interpret Triton kernels in the current process (see conftest), run it (and
tests/backends/rocm, which runs the same kernels with AMD launch configs) in a fresh process with
``TRITON_INTERPRET=1`` set from the start, and fail if any of its tests fails."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backends.triton import conftest

HERE = Path(__file__).resolve().parent


@pytest.mark.subprocess_runner
def test_folder_in_fresh_interpreter_process():
    if conftest.IN_PROCESS:
        pytest.skip("the kernels run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    folders = [str(HERE), str(HERE.parent / "rocm")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *folders, "-p", "no:cacheprovider"],
                          cwd=HERE.parents[2], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
