"""The `glm5` command: unknown commands and help, exit codes, fail-fast on unavailable backends."""
import pytest

from glm5_core import registry
from tests.glm5_command import glm5, glm5_here


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


def test_a_missing_optional_package_is_one_line_naming_its_extra(tmp_path, capsys, monkeypatch):
    """A fresh `pip install -e .[metrics]` has no tokenizers: `glm5 make-tokenizer` (the README's agent line) was a
    traceback; every command's missing optional package is now one line naming the extra that installs it."""
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ModuleNotFoundError
    code, err = glm5_here(capsys, "make-tokenizer", str(tmp_path / "tok"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tokenizers package is not installed" in err and "pip install 'glm5-core[agents]'" in err
