"""The rocm tests run the shared Triton kernels with AMD launch configs: the same interpreter fixtures as
tests/backends/triton (whose test_in_subprocess.py also runs this folder when this process cannot interpret)."""
from tests.backends.triton.conftest import _triton_mode, device, pytest_configure  # noqa: F401
