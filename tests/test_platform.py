"""Hardware and environment probes (``glm5_core.platform``)."""
import pytest


@pytest.mark.parametrize("value,enabled", [("1", True), ("true", True), ("ON", True), ("yes", True), ("y", True),
                                           ("0", False), ("false", False), ("False", False), ("off", False),
                                           ("no", False), ("", False)])
def test_triton_interpret_is_read_the_way_triton_reads_it(monkeypatch, value, enabled):
    """Triton takes 1/true/on/yes/y (any case) as true and anything else as false; a ``TRITON_INTERPRET=false``
    read as "interpreter on" made the cuda backend unavailable on a GPU ("set after triton was imported")."""
    from glm5_core import platform

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert platform.triton_interpreter_enabled() is enabled
