"""Typed run configuration of ``glm5 rl`` (YAML -> dataclasses; unknown keys are errors).

``rollout.temperature`` is the one sampling temperature of a run: the engines sample at it and the trainer
recomputes log-probs at it (there is no separate trainer temperature; ``train.optim.temperature`` is
rejected). It must be > 0: greedy rollouts record log-probs no policy ratio refers to."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Union

from glm5_core.rl.algorithm.trainer import TrainerConfig
from glm5_core.rl.serving.sampling import check_top_p, check_training_temperature

ENVIRONMENTS = ("arithmetic", "calculator")


@dataclasses.dataclass
class RolloutConfig:
    num_engines: int = 1
    max_batch: int = 16
    max_len: int = 128
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_inflight_groups: int = 8
    max_buffered: int = 64  # async: pause new groups while this many trajectories wait for the trainer
    engine_threads: int = 1
    routing: str = "dp_aware"  # or "round_robin"
    virtual_nodes: int = 150
    imbalance_factor: float = 1.5
    prefix_cache_entries: int = 256  # per engine: trajectories whose KV is kept between turns (0: none)
    prefix_cache_tokens: Optional[int] = None  # per engine: cached KV positions in all (None: no token budget)
    episode_threads: int = 64
    engine_urls: Optional[List[str]] = None  # external engines (SGLang, glm5 serve): start none, route over these
    api_key: Optional[str] = None  # bearer token the engines were started with (SGLang's --api-key)
    weight_sync: str = "disk"  # or "distributed" (see rl/fleet/weight_sync.py)
    flush_cache_on_sync: bool = True
    sync_bucket_mb: float = 64.0  # distributed: tensors per /update_weights_from_distributed call
    sync_master_address: str = "127.0.0.1"  # distributed: the trainer's address the engines connect to
    sync_backend: str = "gloo"  # distributed: "gloo", "nccl" or "hccl"
    devices: Optional[Union[str, List[str]]] = None  # spawned engines: "cuda:1,cuda:2" (one per engine, or one)


@dataclasses.dataclass
class RLTrainConfig:
    batch_size: int = 64
    max_staleness: Optional[int] = 4
    teacher_checkpoint: Optional[str] = None
    device: Optional[str] = None  # the trainer's device, e.g. "cuda:0" (None: the backend's default)
    max_idle_minutes: float = 10.0  # a trainer that receives no batch for this long ends the run (non-zero)
    optim: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)


@dataclasses.dataclass
class EvalConfig:
    every: int = 0  # trainer steps between evaluations (0: only at start and end)
    samples_per_problem: int = 4


@dataclasses.dataclass
class RLConfig:
    seed: int = 0
    mode: str = "async"
    executor: str = "local"
    output_dir: str = "runs/rl"
    max_minutes: float = 14.0
    max_steps: int = 1000
    torch_threads: int = 1
    env: Dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "arithmetic"})
    model: Dict[str, Any] = dataclasses.field(default_factory=lambda: {"preset": "tiny", "overrides": {}})
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    train: RLTrainConfig = dataclasses.field(default_factory=RLTrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def validate(self) -> "RLConfig":
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode: expected 'sync' or 'async', got {self.mode!r}")
        if self.executor not in ("local", "ray"):
            raise ValueError(f"executor: expected 'local' or 'ray', got {self.executor!r}")
        if self.env.get("name") not in ENVIRONMENTS:
            raise ValueError(f"env.name: expected one of {ENVIRONMENTS}, got {self.env.get('name')!r}")
        if self.rollout.routing not in ("dp_aware", "round_robin"):
            raise ValueError(f"rollout.routing: expected 'dp_aware' or 'round_robin', got {self.rollout.routing!r}")
        for name in ("num_engines", "max_batch", "max_len", "group_size", "max_inflight_groups", "engine_threads"):
            value = getattr(self.rollout, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name}: expected an int >= 1, got {value!r}")
        entries, tokens = self.rollout.prefix_cache_entries, self.rollout.prefix_cache_tokens
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
            raise ValueError(f"rollout.prefix_cache_entries: expected an int >= 0, got {entries!r}")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"rollout.prefix_cache_tokens: expected null or an int >= 1, got {tokens!r}")
        check_training_temperature(self.rollout.temperature, "rollout.temperature")
        check_top_p(self.rollout.top_p, "rollout.top_p")
        if self.train.batch_size % self.rollout.group_size:
            raise ValueError(f"train.batch_size: expected a multiple of rollout.group_size={self.rollout.group_size}, "
                             f"got {self.train.batch_size}")
        if not self.max_minutes > 0 or self.max_steps < 1:
            raise ValueError(f"max_minutes / max_steps: expected > 0 / >= 1, got {self.max_minutes} / {self.max_steps}")
        self.train.optim.validate()
        self._validate_fleet()
        return self

    def _validate_fleet(self) -> None:
        """External engines, weight sync, placement, and pushes the staleness bound can keep up with."""
        r, t = self.rollout, self.train
        if r.weight_sync not in ("disk", "distributed"):
            raise ValueError(f"rollout.weight_sync: expected 'disk' or 'distributed', got {r.weight_sync!r}")
        if r.sync_backend not in ("gloo", "nccl", "hccl"):
            raise ValueError(f"rollout.sync_backend: expected 'gloo', 'nccl' or 'hccl', got {r.sync_backend!r}")
        if isinstance(r.sync_bucket_mb, bool) or not isinstance(r.sync_bucket_mb, (int, float)) \
                or not 0 < r.sync_bucket_mb <= 1 << 16:
            raise ValueError(f"rollout.sync_bucket_mb: expected a number in (0, 65536], got {r.sync_bucket_mb!r}")
        if not isinstance(r.flush_cache_on_sync, bool):
            raise ValueError(f"rollout.flush_cache_on_sync: expected true or false, got {r.flush_cache_on_sync!r}")
        if r.engine_urls is not None:
            from glm5_core.rl.serving.client import check_engine_url

            if not isinstance(r.engine_urls, list) or not r.engine_urls:
                raise ValueError(f"rollout.engine_urls: expected a list of http://HOST:PORT, got {r.engine_urls!r:.80}")
            for i, url in enumerate(r.engine_urls):
                check_engine_url(url, allow_remote=True, where=f"rollout.engine_urls[{i}]")
            if r.devices is not None:
                raise ValueError("rollout.devices: engines at rollout.engine_urls run where they were started; "
                                 "remove rollout.devices")
        if r.api_key is not None and (not isinstance(r.api_key, str) or not r.api_key):
            raise ValueError("rollout.api_key: expected a non-empty string or null")
        from glm5_core.rl.fleet.placement import engine_devices, parse_device

        engine_devices(r.devices, r.num_engines)
        if t.device is not None:
            parse_device(t.device, "train.device")
        if isinstance(t.max_idle_minutes, bool) or not isinstance(t.max_idle_minutes, (int, float)) \
                or not t.max_idle_minutes > 0:
            raise ValueError(f"train.max_idle_minutes: expected minutes > 0, got {t.max_idle_minutes!r}")
        push_every = t.optim.push_every
        if t.max_staleness is not None and push_every > t.max_staleness + 1:
            raise ValueError(f"train.optim.push_every={push_every} > train.max_staleness + 1 = {t.max_staleness + 1}: "
                             "after the first push every sample would be too stale to train on; lower push_every or "
                             "raise max_staleness")


def _build(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    if where.endswith("train.optim") and "temperature" in data:
        raise ValueError(f"train.optim.temperature: the trainer recomputes log-probs at rollout.temperature (the "
                         f"importance ratio needs both at one temperature); remove train.optim.temperature="
                         f"{data['temperature']!r} and set rollout.temperature instead")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected some of {sorted(fields)}")
    kwargs = {}
    for key, value in data.items():
        default = fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), value, f"{where}.{key}" if where else key)
        elif key == "betas":
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(data: Dict[str, Any]) -> RLConfig:
    return _build(RLConfig, data, "config").validate()


def load_config(path: str, overrides: Optional[Dict[str, Any]] = None,
                rollout_overrides: Optional[Dict[str, Any]] = None) -> RLConfig:
    import yaml

    with open(path, "r", encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    for key, value in (overrides or {}).items():
        data[key] = value
    if rollout_overrides:
        rollout = data.setdefault("rollout", {})
        if not isinstance(rollout, dict):
            raise ValueError(f"config.rollout: expected a mapping, got {type(rollout).__name__}")
        rollout.update(rollout_overrides)
    return config_from_dict(data)
