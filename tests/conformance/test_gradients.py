"""Every backend keeps gradients wherever the reference does, and they match (checks in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("gradients"), ids=str)
def test_gradients(backend, check):
    conformance.assert_conforms(backend, check)
