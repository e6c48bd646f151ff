"""The Ray executor on a local Ray instance: workers start as actors, serve /generate, and a killed actor is
replaced by the supervisor. Skipped when ray (the [rl] extra) is not installed."""
import os

import pytest
import torch

ray = pytest.importorskip("ray")

from glm5_core.rl.fleet.replicas import ReplicaSet  # noqa: E402
from glm5_core.rl.fleet.router import ConsistentHashRouter  # noqa: E402
from glm5_core.rl.serving.worker import WorkerSpec  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_ray_workers_serve_and_get_replaced(local_ray, tmp_path):
    from safetensors.torch import save_file

    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.fleet.executors.ray_executor import RayExecutor

    cfg = GLM5Config.tiny()
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg)
    weights = os.path.join(tmp_path, "v000000.safetensors")
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, weights)

    def spec(name):
        return WorkerSpec(model_config=cfg.to_hf_dict(), weights_path=weights, weight_version=0,
                          weights_dir=str(tmp_path), max_batch=2, max_len=64, backend="cpu")

    replicas = ReplicaSet(RayExecutor(spec), ConsistentHashRouter(), ["engine0"], poll_seconds=0.2).start()
    try:
        request = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                   "return_logprob": True}
        first = replicas.generate("t0", dict(request, rid="t0"))
        old_pid = replicas.executor.pid("engine0")
        replicas.executor.kill("engine0")
        again = replicas.generate("t1", dict(request, rid="t1"))  # retried until the replacement serves
        assert replicas.replacements >= 1 and replicas.executor.pid("engine0") != old_pid
        assert again["output_ids"] == first["output_ids"]  # same weights, greedy: same tokens
    finally:
        replicas.shutdown()
