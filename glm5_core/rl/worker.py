"""What a rollout-engine worker runs, whichever executor started it: build the policy from a config and a
safetensors weights file, wrap it in a :class:`RolloutEngine` and serve it over HTTP on 127.0.0.1."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional


@dataclasses.dataclass
class WorkerSpec:
    model_config: Dict[str, Any]  # HF glm_moe_dsa config dict
    weights_path: str  # safetensors file with the weights to start from
    weight_version: int
    weights_dir: str  # the only directory /update_weights_from_disk may read from
    backend: Optional[str] = None
    max_batch: int = 8
    max_len: int = 256
    prefix_cache_entries: int = 256
    record_topk: bool = False
    seed: int = 0
    torch_threads: int = 1


def build_model(spec: WorkerSpec):
    """The engine's policy (random init, weights come from ``spec.weights_path``) on the backend's device."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.device import runtime_device

    model = GLM5ForCausalLM(GLM5Config.from_hf_dict(spec.model_config), backend=spec.backend)
    return model.to(runtime_device(spec.backend))


def build_server(spec: WorkerSpec):
    """Model + engine + (not yet started) HTTP server for ``spec``."""
    import torch

    from glm5_core.rl.engine import RolloutEngine
    from glm5_core.rl.server import EngineServer, load_weights_file

    torch.set_num_threads(max(1, int(spec.torch_threads)))
    model = build_model(spec)
    engine = RolloutEngine(model, max_batch=spec.max_batch, max_len=spec.max_len,
                           prefix_cache_entries=spec.prefix_cache_entries, seed=spec.seed,
                           record_topk=spec.record_topk, reuse_stacked_weights=True)  # the worker owns the model
    engine.update_weights(load_weights_file(spec.weights_path), spec.weight_version)
    return EngineServer(engine, weights_dir=spec.weights_dir)


def process_main(spec: WorkerSpec, conn) -> None:
    """Entry point of a local worker process: report the port through ``conn``, then serve until killed."""
    try:
        server = build_server(spec)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("port", server.port))
    conn.close()
    server.serve_forever()
