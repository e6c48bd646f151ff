"""Conformance of every backend under test for the moe family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("moe"), ids=str)
def test_moe(backend, check):
    conformance.assert_conforms(backend, check)
