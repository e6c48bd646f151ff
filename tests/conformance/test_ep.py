"""Conformance of every backend under test for the ep family (checks defined in glm5_core.conformance.ep)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("ep"), ids=str)
def test_ep(backend, check):
    conformance.assert_conforms(backend, check)
