"""Huawei Ascend backend: torch_npu operators."""
