"""Seconds per weight push, disk vs distributed (``rollout.weight_sync``), trainer and one engine in separate
processes on this machine, for the tiny preset and the small config (configs/small.yaml's model).

    python benchmarks/rl_weight_sync.py [--rounds 3] [--bucket-mb 64] [--out benchmarks/results/rl_weight_sync.json]

disk: ``save_pretrained`` into ``<tmp>/hf`` + pause / ``/update_weights_from_disk`` (the engine's
``load_pretrained``) / continue. distributed: pause / buckets of ``/update_weights_from_distributed`` with gloo
broadcasts / continue (the group is formed once, before the rounds, as a run forms it once). The two paths
alternate within each round; medians over rounds. Every push ends with the engine holding the trainer's weights.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch
import yaml
from _results import write_json

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.rl.fleet.weight_sync import DiskWeightSync, DistributedWeightSync, write_hf_directory
from glm5_core.rl.serving.client import EngineClient


def small_config() -> GLM5Config:
    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "small.yaml"), encoding="utf-8") as f:
        model = dict(yaml.safe_load(f)["model"])
    model.pop("preset")
    return GLM5Config.tiny(**model)


def engine_main(hf_config: dict, conn) -> None:
    torch.set_num_threads(1)
    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.server import EngineServer

    model = GLM5ForCausalLM(GLM5Config.from_hf_dict(hf_config)).eval()
    server = EngineServer(RolloutEngine(model, max_batch=2, max_len=64), weight_version="default").start()
    conn.send(server.url)
    conn.recv()
    server.shutdown()


class OneReplica:
    def __init__(self, client):
        self.client = client

    def healthy_clients(self):
        return {"engine0": self.client}

    def mark_failed(self, name):
        raise RuntimeError(f"{name} failed a push")


def measure(name: str, config: GLM5Config, rounds: int, bucket_mb: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine_main, args=(config.to_hf_dict(), child), daemon=True)
    proc.start()
    try:
        client = EngineClient(parent.recv())
        trainer = GLM5ForCausalLM(config)
        params = sum(t.numel() for t in trainer.state_dict().values())
        nbytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
        disk, dist = DiskWeightSync(OneReplica(client)), DistributedWeightSync(
            OneReplica(client), bucket_bytes=int(bucket_mb * (1 << 20)), timeout_s=600)
        dist.push(trainer, 0)  # forms the group (once per run)
        dist.seconds.clear()
        disk_s = []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                version = 2 * r + 1
                t0 = time.monotonic()
                path = write_hf_directory(trainer, os.path.join(tmp, "hf"))
                disk.push(path, version)
                disk_s.append(time.monotonic() - t0)
                dist.push(trainer, version + 1)
                if dist.failed_pushes:
                    raise RuntimeError(dist.last_error)
        dist.shutdown()
        return {"config": name, "parameters": params, "bytes": nbytes, "rounds": rounds, "bucket_mb": bucket_mb,
                "disk_s": disk_s, "distributed_s": list(dist.seconds),
                "disk_median_s": statistics.median(disk_s), "distributed_median_s": statistics.median(dist.seconds)}
    finally:
        parent.send("stop")
        proc.join(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--out", default="benchmarks/results/rl_weight_sync.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results = [measure("tiny", GLM5Config.tiny(), args.rounds, args.bucket_mb),
               measure("small", small_config(), args.rounds, args.bucket_mb)]
    write_json(args.out, {"command": "python " + " ".join(sys.argv), "results": results,
                          "machine": f"{os.cpu_count()} CPU cores (shared), torch {torch.__version__}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
