"""A readmitted engine (restarted, or healthy again after missing pushes) gets the newest weights before the ring
takes it back (ReplicaSet.catch_up = the weight sync's catch_up), by disk and over a distributed group of the
trainer and that engine alone, against the SGLang stand-in (a fresh process: what a restarted SGLang is)."""
import threading
import time

import torch

from glm5_core.rl.fleet.replicas import ReplicaSet
from glm5_core.rl.fleet.router import ConsistentHashRouter
from glm5_core.rl.serving.client import EngineClient


class Executor:
    def __init__(self):
        self.alive = {}

    def start(self, name):
        self.alive[name] = True
        return "http://127.0.0.1:9"

    def is_alive(self, name):
        return self.alive[name]

    def restart(self, name):
        return self.start(name)

    def shutdown(self):
        pass


class Healthy:
    def __init__(self, url):
        self.url = url

    def health(self, timeout=2.0):
        return True


def wait_until(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_the_ring_takes_a_replica_back_only_after_its_catch_up():
    executor = Executor()
    replicas = ReplicaSet(executor, ConsistentHashRouter(), ["engine0"], poll_seconds=0.01,
                          client_factory=Healthy)
    seen = []
    lock = threading.Lock()

    def catch_up(name, client, admit):
        with lock:
            seen.append((name, list(replicas.router.healthy_replicas())))
            if len(seen) == 1:
                raise RuntimeError("the engine refused the weights")  # stays off the ring, tried again
        admit()

    replicas.catch_up = catch_up
    replicas.start()
    try:
        replicas.router.mark_unhealthy("engine0")  # a failed push or request: it may have missed weights
        assert wait_until(lambda: replicas.router.healthy_replicas() == ["engine0"])
        assert seen[:2] == [("engine0", []), ("engine0", [])] and replicas.failed_restarts == 1
        executor.alive["engine0"] = False  # the worker dies: restarted, then caught up
        assert wait_until(lambda: replicas.replacements == 1 and replicas.router.healthy_replicas() == ["engine0"])
        assert len(seen) == 3 and seen[2] == ("engine0", [])
    finally:
        replicas.shutdown()


class NoEngines:
    """A fleet with no healthy engine: a push only records what a catch-up sends."""

    def healthy_clients(self):
        return {}

    def mark_failed(self, name):
        raise AssertionError(name)


def test_a_restarted_sglang_gets_the_newest_weights_by_each_path(tmp_path):
    from safetensors.torch import load_file, save_file

    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.fleet.weight_sync import DiskWeightSync, DistributedWeightSync, write_hf_directory
    from tests.rl.serving.sglang_standin import StandInProcess
    from tests.rl.serving.test_sglang_standin import random_policy

    server = StandInProcess(random_policy(tmp_path / "boot"), sglang_version="0.5.23")  # boots other weights
    try:
        client = EngineClient(server.url)
        admitted = []
        torch.manual_seed(7)
        trainer = GLM5ForCausalLM(GLM5Config.tiny(index_topk=8, max_position_embeddings=64))
        saved = str(tmp_path / "v000007.safetensors")
        save_file({k: v.contiguous() for k, v in trainer.state_dict().items()}, saved)
        sync = DistributedWeightSync(NoEngines(), bucket_bytes=1 << 18, timeout_s=60)
        sync.push(trainer, 7, saved=saved)
        sync.catch_up("engine0", client, lambda: admitted.append(server.state()["weight_version"]))
        sync.shutdown()
        assert admitted == ["7"] and sync.catch_ups == 1
        calls = server.state()["calls"]
        assert calls.count("/begin_weight_update") == calls.count("/end_weight_update") == 1
        assert "/pause_generation" not in calls  # it takes no work yet: nothing to pause
        server.save_weights(tmp_path / "engine.safetensors")
        engine = load_file(str(tmp_path / "engine.safetensors"))
        assert all(torch.equal(engine[k], v) for k, v in trainer.state_dict().items())

        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1.0)
        disk = DiskWeightSync(NoEngines())
        disk.push(write_hf_directory(trainer, str(tmp_path / "hf")), 8)
        disk.catch_up("engine0", client, lambda: admitted.append(server.state()["weight_version"]))
        assert admitted == ["7", "8"] and disk.catch_ups == 1
        server.save_weights(tmp_path / "engine.safetensors")
        engine = load_file(str(tmp_path / "engine.safetensors"))
        assert all(torch.equal(engine[k], v) for k, v in trainer.state_dict().items())
    finally:
        server.shutdown()
