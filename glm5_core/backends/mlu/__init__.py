"""Cambricon backend: MLUs through torch_mlu (device type ``mlu``), the shared Triton kernels (Triton for MLU) with
its launch table. Facts and sources: docs/vendors/mlu.md."""
