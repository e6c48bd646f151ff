"""Engine workers as Ray actors (the ``[rl]`` extra), for rollout engines spread over several machines.

Each actor builds the engine with :func:`glm5_core.rl.serving.worker.build_server` and serves HTTP on its node's
127.0.0.1, so the driver must run on the same node as the actors it talks to (for multi-node, one driver-side
gateway per node); on one machine ``ray.init()`` starts a local instance. ``ray`` is imported only here.
An engine placed on an accelerator (``rollout.devices``) asks Ray for it (its vendor's Ray resource, e.g.
``num_gpus=1``), so Ray schedules it where one is free and makes only that one visible to it.
"""
from __future__ import annotations

from typing import Callable, Optional

from glm5_core.rl.fleet.executors.boot_weights import BootWeights
from glm5_core.rl.fleet.executors.worker_placement import placed
from glm5_core.rl.serving.worker import WorkerSpec


def _actor_class():
    import ray

    @ray.remote(num_cpus=1)
    class EngineActor:
        def __init__(self, spec: WorkerSpec):
            import os

            from glm5_core.rl.serving.worker import build_server, pin_to_cores

            pin_to_cores(spec.cpu_cores)
            self._server = build_server(spec).start()
            self._pid = os.getpid()

        def port(self) -> int:
            return self._server.port

        def pid(self) -> int:
            return self._pid

    return EngineActor


class RayExecutor:
    def __init__(self, spec_fn: Callable[[str], WorkerSpec], *, address: Optional[str] = None,
                 num_cpus: Optional[int] = None,
                 start_timeout: float = 300.0):
        try:
            import ray
        except ImportError as exc:
            raise ValueError("executor: 'ray' needs the ray package (pip install 'glm5-core[rl]')") from exc
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True)
        self._spec_fn = spec_fn
        self._start_timeout = start_timeout
        self._actor_cls = _actor_class()
        self._actors: dict[str, object] = {}
        self._pids: dict[str, int] = {}
        self.boot_weights = BootWeights()  # weights pinned per replica before it boots (see boot_weights)

    def start(self, name: str) -> str:
        from glm5_core.rl.fleet.placement import ray_resources

        spec = placed(self.boot_weights.pin(name, self._spec_fn))
        actor = self._actor_cls.options(name=None, max_restarts=0, **ray_resources(spec.placement)).remote(spec)
        port = self._ray.get(actor.port.remote(), timeout=self._start_timeout)
        self._pids[name] = self._ray.get(actor.pid.remote(), timeout=self._start_timeout)
        self._actors[name] = actor
        return f"http://127.0.0.1:{port}"

    def is_alive(self, name: str) -> bool:
        actor = self._actors.get(name)
        if actor is None:
            return False
        try:
            self._ray.get(actor.pid.remote(), timeout=10)
            return True
        except Exception:
            return False

    def pid(self, name: str) -> int:
        return self._pids[name]

    def kill(self, name: str) -> None:
        self._ray.kill(self._actors[name], no_restart=True)

    def restart(self, name: str) -> str:
        old = self._actors.pop(name, None)
        if old is not None:
            try:
                self._ray.kill(old, no_restart=True)
            except Exception:
                pass
        return self.start(name)

    def shutdown(self) -> None:
        for actor in self._actors.values():
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self._actors.clear()
        self.boot_weights.remove_all()
