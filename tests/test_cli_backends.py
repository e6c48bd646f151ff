"""`glm5 backends`: every backend with its status, and ``--backend`` taken like every command takes it."""
import json

from glm5_core import registry
from tests.glm5_command import glm5


def test_backends_lists_every_backend_with_its_status():
    proc = glm5("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    records = {r["backend"]: r for r in json.loads(proc.stdout)}
    for name, be in registry.backends().items():
        ok, reason = be.available()
        assert records[name]["available"] == ok and records[name]["reason"].startswith(reason)
        assert records[name]["dist_backend"] == be.dist_backend
    assert records["cpu"]["available"]
    assert set(records["cpu"]["ops"]) == set(registry.OP_NAMES)
    text = glm5("backends").stdout
    assert "cpu" in text and "dist" in text and "muon_orthogonalize" in text


def test_backends_takes_backend_like_every_command():
    proc = glm5("backends", "--json", "--backend", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert [r["backend"] for r in json.loads(proc.stdout)] == ["cpu"]
    ok, reason = registry.get_backend("ascend").available()
    if not ok:
        proc = glm5("backends", "--backend", "ascend")
        assert proc.returncode == 2 and f"ascend: {reason}" in proc.stderr
    proc = glm5("backends", "--backend", "tpu")
    assert proc.returncode == 2 and "backend: expected 'auto' or one of" in proc.stderr
