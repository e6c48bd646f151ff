"""Declaration of the ``cuda`` backend. Import-light: triton is imported only by ``kernel_table``."""
import sys
from typing import Callable, Dict

from glm5_core import platform
from glm5_core.registry import Backend


def interpreter_verdict():
    """Why Triton's interpreter cannot run kernels in this process, or None.

    Triton decorates its own ``triton.language`` helpers when triton is imported: if that happened
    before ``TRITON_INTERPRET=1`` was set, interpreted kernels fail on the first helper they call."""
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(getattr(standard, "zeros", None)).__name__ == "JITFunction":
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before Python starts"
    return None


def probe():
    ok, why = platform.triton_probe()
    if platform.triton_interpreter_enabled():
        if not ok:
            return False, f"TRITON_INTERPRET=1 but {why}"
        late = interpreter_verdict()
        if late:
            return False, late
        return True, f"Triton interpreter on CPU tensors (TRITON_INTERPRET=1), {why}"
    gpu_ok, gpu_why = platform.gpu_probe("cuda")
    if not gpu_ok:
        return False, gpu_why
    if not ok:
        return False, why
    return True, f"{gpu_why}, {why}"


def runtime_device() -> str:
    return "cpu" if platform.triton_interpreter_enabled() else "cuda"


def kernel_table() -> Dict[str, Callable]:
    """Triton kernels with NVIDIA launch configs (triton is imported here, not at import time)."""
    from glm5_core.backends.cuda.launch import CUDA_CONFIGS
    from glm5_core.backends.cuda.table import build_kernel_table

    return build_kernel_table(CUDA_CONFIGS)


# Ops left to the reference, and why (shown by `glm5 backends`).
MISSING = {
    "mla_prefill": "dense MLA prefill is left to torch (SDPA-class kernels); DSA's sparse path is the cuda kernel",
}


BACKEND = Backend(
    name="cuda",
    device_type="cuda",
    dist_backend="nccl",
    probe=probe,
    kernel_table=kernel_table,
    missing=MISSING,
    runtime_device=runtime_device,
    description="NVIDIA GPUs: Triton kernels + csrc CUDA ops",
)
