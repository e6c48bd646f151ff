"""Backends, one folder per vendor (``glm5_core/backends/<vendor>/``: its ``backend.py`` declaration, kernel
table, launch configurations and native sources), plus ``triton/``: the vendor-neutral Triton kernels that
cuda, rocm and any other vendor with a Triton backend launch with their own configurations. Importing this
package imports no vendor SDK."""
