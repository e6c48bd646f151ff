"""Shared helpers of the cuda / rocm kernel tests."""
import torch

# Kernel vs reference, both computing in fp32: fp32 outputs agree to rounding; 16-bit outputs differ by at
# most about one rounding of the output dtype.
SAME_PRECISION_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    atol, rtol = SAME_PRECISION_TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def kernel(op: str, backend: str = "cuda"):
    """The backend's registered kernel record for ``op`` (callable; ``.supports`` its hook). Call inside a test:
    it imports the Triton modules."""
    from glm5_core import registry

    return registry.resolve(op, backend).kernel
