"""NVIDIA backend: Triton kernels (also runnable on CPU tensors under ``TRITON_INTERPRET=1``)."""
