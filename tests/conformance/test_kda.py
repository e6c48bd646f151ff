"""Conformance of every backend under test for the kda family (checks defined in glm5_core.conformance)."""
import pytest

from glm5_core import conformance


@pytest.mark.parametrize("check", conformance.checks("kda"), ids=str)
def test_kda(backend, check):
    conformance.assert_conforms(backend, check)
