"""`glm5 rl` puts the policy and every engine model on the backend's runtime device, and the engine and the
trainer create their tensors on the device of the model they were given.

Only the CPU runs here, so the backend's device is faked as ``meta`` (a real torch device that holds shapes
only) where nothing has to be computed; where something must run, the tests check that the code reads the
device from the model and hands the model tensors on it.
"""
import dataclasses

import pytest
import torch

from glm5_core import registry
from glm5_core.rl.algorithm.trainer import pad_samples
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.device import module_device, runtime_device
from glm5_core.rl.rollout.trajectory import Sample
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest


@pytest.fixture
def meta_cpu_backend(monkeypatch):
    """The cpu backend, reporting ``meta`` as its runtime device."""
    fake = dataclasses.replace(registry.get_backend("cpu"), runtime_device=lambda: "meta")
    real = registry.require_available
    monkeypatch.setattr(registry, "require_available", lambda name: fake if name == "cpu" else real(name))
    return fake


def test_runtime_device_is_the_backends_device(meta_cpu_backend):
    assert runtime_device("cpu") == torch.device("meta")


def test_runtime_device_of_the_real_cpu_backend():
    assert runtime_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError):
        runtime_device("no-such-backend")


def _all_tensors(model):
    return list(model.parameters()) + list(model.buffers())


def test_policy_is_built_on_the_backend_device(meta_cpu_backend):
    from glm5_core.rl.policy import build_policy

    cfg = config_from_dict({"model": {"preset": "tiny", "overrides": {"num_hidden_layers": 2,
                                                                      "indexer_types": ["full", "shared"]}}})
    model = build_policy(cfg, None, "cpu")
    assert {t.device.type for t in _all_tensors(model)} == {"meta"}


def test_engine_worker_model_is_built_on_the_backend_device(meta_cpu_backend):
    from glm5_core.model import GLM5Config
    from glm5_core.rl.serving.worker import WorkerSpec, build_model

    spec = WorkerSpec(model_config=GLM5Config.tiny(num_hidden_layers=2, indexer_types=["full", "shared"]).to_hf_dict(),
                      weights_path="unused", weight_version=0, weights_dir="unused", backend="cpu")
    assert {t.device.type for t in _all_tensors(build_model(spec))} == {"meta"}


def test_pad_samples_creates_the_batch_on_the_requested_device():
    s = Sample()
    s.append([5, 6, 7], sampled=False)
    s.append([8, 9], sampled=True, logprobs=[-0.5, -1.5], versions=[0, 0])
    batch = pad_samples([s], torch.device("meta"))
    assert {t.device.type for t in batch.values()} == {"meta"}
    assert all(t.shape == (1, 4) for k, t in batch.items() if k != "input_ids")


def test_engine_feeds_the_model_tensors_on_the_models_device(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=64, seed=0)
    assert engine.device == module_device(tiny_policy)
    seen = []
    forward = engine._forward

    def spy(input_ids, cache, start_pos):
        seen.append({input_ids.device} | ({start_pos.device} if isinstance(start_pos, torch.Tensor) else set())
                    | {t.device for t in cache.c_kv})
        return forward(input_ids, cache, start_pos)

    engine._forward = spy
    engine.generate([GenerateRequest("a", [1, 2, 3], max_new_tokens=3),
                     GenerateRequest("b", [4, 5, 6, 7, 8], max_new_tokens=2)])  # ragged prefill: tensor start_pos
    assert len(seen) >= 3 and all(devices == {engine.device} for devices in seen)
