"""What a rollout-engine worker runs, whichever executor started it: build the policy from a config and a
safetensors weights file, wrap it in a :class:`RolloutEngine` and serve it over HTTP on 127.0.0.1.

A local worker process watches its parent (:func:`exit_with_parent`): when the driver dies without shutting
it down (SIGKILL, OOM killer) the worker is re-parented, notices, and exits instead of holding its memory and
port forever."""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

EXIT_ORPHANED = 3  # exit status of a worker whose parent died


@dataclasses.dataclass
class WorkerSpec:
    model_config: dict[str, Any]  # HF glm_moe_dsa config dict
    weights_path: str  # safetensors file with the weights to start from
    weight_version: int
    weights_dir: str  # the only directory /update_weights_from_disk may read from
    backend: Optional[str] = None
    max_batch: int = 8
    max_len: int = 256
    prefix_cache_entries: int = 256
    prefix_cache_tokens: Optional[int] = None
    record_topk: bool = False
    speculative: Optional[dict[str, int]] = None  # {draft_tokens: d}: MTP speculative decoding
    record_routing: bool = False  # replay traces (train.routing_replay / train.index_replay)
    record_index_topk: bool = False
    seed: int = 0
    torch_threads: int = 1
    placement: Optional[str] = None  # rollout.devices entry, e.g. "<type>:2" (None: the backend's default device)
    # derived from ``placement`` by the executor that starts the worker (rl.fleet.executors.worker_placement):
    device: Optional[str] = None  # the engine's torch device inside the worker, e.g. "<type>:0" (None: the backend's)
    environment: dict[str, str] = dataclasses.field(default_factory=dict)  # set first thing in a local worker process
    cpu_cores: Optional[tuple[int, ...]] = None  # a host-device core set: the worker pins itself to these cores


def set_process_affinity(cores) -> None:
    """Every thread of this process on ``cores``: ``os.sched_setaffinity(0)`` moves only the calling thread
    (Linux), so the threads already running (torch's intra-op pool, a caller's) are moved one by one; threads
    started later inherit it."""
    os.sched_setaffinity(0, cores)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread (and the threads it starts) only
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # the thread ended meanwhile
            pass


def pin_to_cores(cores: Optional[tuple[int, ...]]) -> None:
    """Pin this process to ``cores`` (every thread, :func:`set_process_affinity`) with one torch thread per core;
    None: nothing. Called by the worker process itself (a spawned process or a Ray actor), never by an in-process
    engine."""
    if cores is None:
        return
    import torch

    set_process_affinity(cores)
    torch.set_num_threads(len(cores))


def build_model(spec: WorkerSpec):
    """The engine's policy (random init, weights come from ``spec.weights_path``) on the backend's device."""
    from glm5_core.model import GLM5Config, GLM5ForCausalLM
    from glm5_core.rl.device import runtime_device

    model = GLM5ForCausalLM(GLM5Config.from_hf_dict(spec.model_config), backend=spec.backend)
    return model.to(spec.device or runtime_device(spec.backend))


def build_server(spec: WorkerSpec):
    """Model + engine + (not yet started) HTTP server for ``spec``."""
    import torch
    from safetensors.torch import load_file

    from glm5_core.rl.serving.engine import RolloutEngine
    from glm5_core.rl.serving.server import EngineServer

    torch.set_num_threads(len(spec.cpu_cores) if spec.cpu_cores else max(1, int(spec.torch_threads)))
    model = build_model(spec)
    engine = RolloutEngine(model, max_batch=spec.max_batch, max_len=spec.max_len,
                           prefix_cache_entries=spec.prefix_cache_entries,
                           prefix_cache_tokens=spec.prefix_cache_tokens, seed=spec.seed,
                           record_topk=spec.record_topk, reuse_stacked_weights=True,  # the worker owns the model
                           speculative=spec.speculative, record_routing=spec.record_routing,
                           record_index_topk=spec.record_index_topk)
    engine.update_weights(load_file(spec.weights_path), spec.weight_version)
    return EngineServer(engine, weights_dir=spec.weights_dir)


def _exit_orphaned() -> None:
    print(f"rl worker {os.getpid()}: parent process died, exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_ORPHANED)  # nobody is left to shut the server down cleanly


def exit_with_parent(parent_pid: int, *, poll_seconds: float = 0.5,
                     on_orphaned: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Start a daemon thread that calls ``on_orphaned`` (default: exit the process with ``EXIT_ORPHANED``) once
    this process's parent is no longer ``parent_pid`` (it died and the process was re-parented), checking
    every ``poll_seconds``. A parent that died before the thread started is caught on the first check."""
    if isinstance(parent_pid, bool) or not isinstance(parent_pid, int) or parent_pid < 1:
        raise ValueError(f"parent_pid: expected a process id >= 1, got {parent_pid!r}")
    action = on_orphaned or _exit_orphaned

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_seconds)
        action()

    thread = threading.Thread(target=watch, name="rl-worker-parent-watchdog", daemon=True)
    thread.start()
    return thread


def process_main(spec: WorkerSpec, conn, parent_pid: Optional[int] = None) -> None:
    """Entry point of a local worker process: report the port through ``conn``, then serve until killed.
    With ``parent_pid`` (the executor's pid) the worker exits by itself when that process dies. Only the
    accelerator of ``spec.placement`` is made visible (``spec.environment``), before anything touches the device."""
    os.environ.update(spec.environment)
    pin_to_cores(spec.cpu_cores)
    if parent_pid is not None:
        exit_with_parent(parent_pid)
    try:
        server = build_server(spec)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("port", server.port))
    conn.close()
    server.serve_forever()
