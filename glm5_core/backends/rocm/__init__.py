"""AMD backend: the Triton kernels with AMD launch configurations; ``aiter`` ops where installed."""
