"""Conformance of every backend under test for the dsa family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("dsa"), ids=str)
def test_dsa(backend, check):
    conformance.assert_conforms(backend, check)
