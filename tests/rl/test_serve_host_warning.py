"""Issue 35 item 7: ``glm5 serve --host`` on an address other machines reach, without ``--api-key``, warns in one
line on stderr (before anything is loaded); loopback hosts and keyed servers do not."""
import pytest

from glm5_core import cli

WARNING = "glm5 serve: warning: --host"


def serve_stderr(capsys, tmp_path, *flags):
    try:
        cli.main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0", *flags])
    except SystemExit:
        pass
    return capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_a_non_loopback_host_without_a_key_warns(capsys, tmp_path, host):
    err = serve_stderr(capsys, tmp_path, "--host", host)
    (line,) = [line for line in err.splitlines() if line.startswith(WARNING)]
    assert host in line and "--api-key" in line


@pytest.mark.parametrize("flags", [(), ("--host", "127.0.0.1"), ("--host", "localhost"), ("--host", "::1"),
                                   ("--host", "0.0.0.0", "--api-key", "k")])
def test_loopback_or_keyed_servers_do_not_warn(capsys, tmp_path, flags):
    assert WARNING not in serve_stderr(capsys, tmp_path, *flags)
