"""Run the Triton kernels of the cuda / rocm backends: on the GPU when one is here, else on CPU tensors
through Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI checks them.

Triton chooses interpreter-or-compiler when a function is *decorated*: its own ``triton.language``
helpers (``tl.zeros``, ``tl.sum`` ...) at ``import triton``, our kernels when their modules are first
imported (lazily, inside these tests). So, without a GPU:

* if triton is not imported yet, it is imported here with the variable set, then the variable is
  restored; each test sets it again (monkeypatch) so our kernel modules are interpreted too, without
  the variable leaking into other folders (where it would make the cuda backend look available);
* if triton was already imported for the compiler (e.g. by another folder's collection in a
  whole-suite run), the kernels cannot be interpreted in this process: the tests here skip, and
  ``test_in_subprocess.py`` runs this folder in a fresh interpreter process instead.
"""
import importlib
import os
import sys

import pytest

from glm5_core.backends.cuda.device import gpu_probe


def _real_gpu() -> bool:
    return gpu_probe("cuda")[0] or gpu_probe("rocm")[0]


def _interpreter_usable_in_process() -> bool:
    if _real_gpu() or importlib.util.find_spec("triton") is None:
        return True
    if "triton.language" not in sys.modules:
        before = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            importlib.import_module("triton.language")
        finally:
            if before is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = before
    standard = importlib.import_module("triton.language.standard")
    return type(standard.zeros).__name__ == "InterpretedFunction"


IN_PROCESS = _interpreter_usable_in_process()


@pytest.fixture(autouse=True)
def _triton_mode(monkeypatch, request):
    pytest.importorskip("triton")
    if request.node.get_closest_marker("subprocess_runner"):
        return
    if not IN_PROCESS:
        pytest.skip("triton was imported for the compiler before this folder; test_in_subprocess.py runs it")
    if not _real_gpu():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if _real_gpu() else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "subprocess_runner: runs this folder in a fresh process")
