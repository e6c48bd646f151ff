"""Moore Threads backend: MUSA GPUs through torch_musa (device type ``musa``), the shared Triton kernels with its
launch table. Facts and sources: docs/vendors/musa.md."""
