"""Issue 35 item 7: ``glm5 rl`` with external engines (``rollout.engine_urls``): an engine that never answers is
waited for within ``--max-minutes`` (the budget covers reaching the fleet), then one line naming its URL; an engine
URL with credentials is refused like ``reward.url`` (and the password is not repeated into the message)."""
import os
import socket
import time

import pytest

from tests.glm5_command import glm5_here

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "rl_tiny.yaml")




def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_engine_ends_the_run_within_its_budget(tmp_path, capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    code, err = glm5_here(capsys, "rl", "--config", CONFIG, "--engine-url", url, "--max-minutes", "0.03",
                     "--output-dir", str(tmp_path / "run"))
    assert time.monotonic() - start < 60  # the budget is 1.8 s; building the policy takes a few seconds
    lines = [line for line in err.splitlines() if line.startswith("glm5 rl: error:")]
    assert code == 1 and len(lines) == 1 and url in lines[0] and "max_minutes" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("url", ["http://user:secret@127.0.0.1:30000", "http://:secret@127.0.0.1:30000",
                                 "http://127.0.0.1:30000#frag"])
def test_credentials_in_an_engine_url_are_refused(tmp_path, capsys, url):
    code, err = glm5_here(capsys, "rl", "--config", CONFIG, "--engine-url", url, "--check-config",
                     "--output-dir", str(tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1, err
    assert "rollout.engine_urls[0]: expected no credentials or fragment in the URL (use rollout.api_key)" in err
    assert "secret" not in err
    assert not (tmp_path / "run").exists()
