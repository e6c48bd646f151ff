"""C++ (CPU, OpenMP) and CUDA sources of glm5-core's native kernels, compiled on first use."""
from pathlib import Path


def source_dir() -> Path:
    """The folder holding the .cpp / .cu sources (inside the installed package)."""
    return Path(__file__).resolve().parent
