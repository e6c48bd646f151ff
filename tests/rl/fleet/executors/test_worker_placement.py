"""The executors hand a worker its placement as a torch device inside the worker and the environment that makes
only its accelerator visible; the serving worker applies them without reading placement rules."""
import os

import pytest

from glm5_core.rl.fleet.executors.worker_placement import placed
from glm5_core.rl.serving.worker import WorkerSpec


def spec(placement):
    return WorkerSpec(model_config={}, weights_path="w", weight_version=0, weights_dir="d", placement=placement)


@pytest.mark.parametrize("placement, device, environment", [
    ("cuda:2", "cuda:0", {"CUDA_VISIBLE_DEVICES": "2"}),
    ("npu:1", "npu:0", {"ASCEND_RT_VISIBLE_DEVICES": "1"}),
    ("cpu", "cpu", {}),
    (None, None, {}),
])
def test_placed_spec_carries_the_in_worker_device_and_environment(placement, device, environment):
    out = placed(spec(placement))
    assert (out.placement, out.device, out.environment) == (placement, device, environment)
    assert spec(placement).device is None and spec(placement).environment == {}  # the input is left as it was


def test_the_worker_sets_its_environment_before_building(monkeypatch):
    from glm5_core.rl.serving import worker

    seen = {}

    def build_server(s):
        seen["visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError("stop here")

    class Conn:
        def send(self, message):
            seen["sent"] = message

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # restored after the test
    monkeypatch.setattr(worker, "build_server", build_server)
    with pytest.raises(RuntimeError, match="stop here"):
        worker.process_main(placed(spec("cuda:3")), Conn())
    assert seen == {"visible": "3", "sent": ("error", "RuntimeError: stop here")}
