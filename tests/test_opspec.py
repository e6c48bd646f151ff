"""Op declarations (``glm5_core.opspec.OpSpec``) check their fields."""
import pytest

from glm5_core import registry


def test_an_op_is_not_both_differentiable_and_gradient_free():
    with pytest.raises(ValueError, match="either differentiable or gradient_free"):
        registry.OpSpec("x", len, family="dsa", differentiable=True, gradient_free=True)
