"""Kernel table entries (``glm5_core.kernel.Kernel``) check their fields."""
import pytest

from glm5_core import registry


def test_kernel_records_check_their_fields():
    with pytest.raises(TypeError, match="fn: expected a callable"):
        registry.Kernel("not a function")
    with pytest.raises(TypeError, match="supports: expected None or a callable"):
        registry.Kernel(len, supports=(True, ""))
    with pytest.raises(TypeError, match="differentiable: expected a bool"):
        registry.Kernel(len, differentiable="yes")
    with pytest.raises(TypeError, match="kernel table entry: expected a Kernel or a callable"):
        registry.Kernel.of(42)
    record = registry.Kernel(len)
    assert registry.Kernel.of(record) is record and record([1, 2]) == 2
