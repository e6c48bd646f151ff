"""The `glm5` command: unknown commands and help, exit codes, fail-fast on unavailable backends."""
import pytest

from glm5_core import registry
from tests.glm5_command import glm5


@pytest.mark.skipif(registry.get_backend("ascend").available()[0], reason="ascend is available here")
def test_unavailable_backend_fails_fast_with_the_reason(tmp_path):
    proc = glm5("conformance", "--backend", "ascend", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "ascend:" in proc.stderr and registry.get_backend("ascend").available()[1] in proc.stderr
    assert not list(tmp_path.iterdir())


def test_unknown_command_and_help():
    assert glm5("frobnicate").returncode == 2
    proc = glm5("--help")
    assert proc.returncode == 0 and "conformance" in proc.stdout and "pretrain" in proc.stdout
