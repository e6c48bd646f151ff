"""Backends, one folder per vendor (``glm5_core/backends/<vendor>/``: its ``backend.py`` declaration, its
``device.py`` device facts, kernel table, launch configurations and native sources), plus ``triton/``: the
vendor-neutral Triton kernels that every vendor with a Triton backend launches with its own configurations.
Importing this package imports no vendor SDK."""
