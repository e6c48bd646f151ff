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


def triton_vendor_configs():
    """{vendor: its KernelConfigs} for every in-tree vendor whose folder has a ``launch.py`` declaring one (a new
    Triton vendor is found without editing a test). Imports no triton: the launch tables are import-light."""
    import importlib
    import importlib.util

    from glm5_core import registry
    from glm5_core.backends.triton.launch import KernelConfigs

    found = {}
    for name in registry.builtin_backend_names():
        module_name = f"glm5_core.backends.{name}.launch"
        if importlib.util.find_spec(module_name) is None:
            continue
        tables = [value for value in vars(importlib.import_module(module_name)).values()
                  if isinstance(value, KernelConfigs)]
        assert len(tables) == 1, f"{module_name} declares {len(tables)} KernelConfigs, expected one"
        assert tables[0].vendor == name, f"{module_name}: its KernelConfigs' vendor is {tables[0].vendor!r}"
        found[name] = tables[0]
    return found
