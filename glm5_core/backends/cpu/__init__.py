"""CPU backend: native C++/OpenMP kernels from ``csrc/`` (built on first use), reference elsewhere."""
