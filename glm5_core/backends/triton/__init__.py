"""Vendor-neutral Triton kernels and their launchers. A vendor backend with a Triton compiler (a folder of
``glm5_core/backends/`` whose ``launch.py`` declares a :class:`~glm5_core.backends.triton.launch.KernelConfigs`)
builds its kernel table with :func:`glm5_core.backends.triton.table.build_kernel_table` and that table. The kernel
modules import triton: import them from a backend's ``kernel_table()``, never at ``import glm5_core``."""
