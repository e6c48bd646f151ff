"""benchmarks/_base_extension.py: ``kernels("old")`` rebinds ``torch.ops.glm5_cpu`` to the base library's namespace
for the block only (also when the block raises); bad arguments raise naming them. (Building a base tree's extension
takes minutes: the A/B scripts do it, not these tests.)"""
import pytest
import torch

from tests.benchmarks.bench_scripts import load_benchmark


@pytest.fixture
def base_extension(monkeypatch):
    return load_benchmark(monkeypatch, "_base_extension")


def test_old_kernels_are_the_base_namespace_within_the_block_only(base_extension):
    own = torch.ops.glm5_cpu
    with base_extension.kernels("old"):
        assert torch.ops.glm5_cpu is getattr(torch.ops, base_extension.BASE_NAMESPACE) and torch.ops.glm5_cpu is not own
    assert torch.ops.glm5_cpu is own
    with base_extension.kernels("new"):
        assert torch.ops.glm5_cpu is own
    with pytest.raises(RuntimeError, match="inside"):
        with base_extension.kernels("old"):
            raise RuntimeError("inside")
    assert torch.ops.glm5_cpu is own


def test_bad_arguments_are_named(base_extension, tmp_path):
    with pytest.raises(ValueError, match="variant"):
        with base_extension.kernels("base"):
            pass
    with pytest.raises(ValueError, match="base_tree"):
        base_extension.build(tmp_path)  # no glm5_core/backends/cpu/csrc there
