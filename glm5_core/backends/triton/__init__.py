"""Vendor-neutral Triton kernels and their launchers. A vendor backend with a Triton compiler (cuda, rocm, ...)
builds its kernel table from :func:`glm5_core.backends.triton.table.build_kernel_table` with its own
:class:`~glm5_core.backends.triton.launch.KernelConfigs`. Every module here imports triton: import them from a
backend's ``kernel_table()``, never at ``import glm5_core``."""
