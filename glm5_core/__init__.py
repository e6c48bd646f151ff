"""glm5-core: one API over vendor kernels for MLA, DSA, MoE routing and Muon.

Importing this package probes no hardware and imports no vendor SDK.
"""
from glm5_core.registry import (
    BackendCoverageError,
    BackendUnavailableError,
    backends,
    explain,
    resolve_backend_name,
    use_backend,
)

__version__ = "0.1.0"

__all__ = [
    "BackendCoverageError",
    "BackendUnavailableError",
    "backends",
    "explain",
    "resolve_backend_name",
    "use_backend",
    "__version__",
]
