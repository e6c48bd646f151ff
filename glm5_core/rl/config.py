"""Typed run configuration of ``glm5 rl`` (YAML -> dataclasses declared with ``glm5_core.config_schema``).

Every field declares its type and range; :meth:`RLConfig.rule_problems` holds the rules between fields, the
``model`` and ``env`` sections (checked by GLM5Config's and the environment's own declarations), and the
memory the run needs (``glm5_core.rl.run_memory``). Every problem is one line naming its full key.

``rollout.temperature`` is the one sampling temperature of a run: the engines sample at it and the trainer
recomputes log-probs at it (there is no separate trainer temperature; ``train.optim.temperature`` is
rejected). It must be > 0: greedy rollouts record log-probs no policy ratio refers to."""
from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Dict, List, Optional, Sequence

from glm5_core import config_paths
from glm5_core.config_schema import (
    ConfigError,
    build,
    check,
    convert_fields,
    convert_value,
    did_you_mean,
    field,
    positive,
    shown,
    unknown_key,
)
from glm5_core.config_yaml import apply_overrides, assign, load_mapping
from glm5_core.rl.algorithm.trainer import TrainerConfig
from glm5_core.rl.serving.sampling import check_top_p, check_training_temperature

ENVIRONMENTS = ("arithmetic", "calculator")
MODES = ("sync", "async")
EXECUTORS = ("local", "ray")
ROUTINGS = ("dp_aware", "round_robin")
MAX_SEED = 2 ** 53  # engine seeds are seed * 1000 + engine + 7919 * version: within torch's 64-bit seeds
MAX_THREADS = 4096


WEIGHT_SYNCS = ("disk", "distributed")
SYNC_BACKENDS = ("gloo", "nccl", "hccl")


def _check_engine_urls(urls, key: str) -> None:
    from glm5_core.rl.serving.client import check_engine_url

    if not urls:
        raise ValueError(f"{key}: expected a non-empty list of http://HOST:PORT, got []")
    for i, url in enumerate(urls):
        check_engine_url(url, allow_remote=True, where=f"{key}[{i}]")


def _check_api_key(key_value, key: str) -> None:
    if not key_value:
        raise ValueError(f"{key}: expected a non-empty string or null, got ''")


def _check_devices(devices, key: str) -> None:
    from glm5_core.rl.fleet.placement import parse_devices

    if devices is not None:
        parse_devices(devices, key)


def _check_device(device, key: str) -> None:
    from glm5_core.rl.fleet.placement import parse_device

    parse_device(device, key)


@dataclasses.dataclass
class RolloutConfig:
    num_engines: int = field(1, range=(1, None))
    max_batch: int = field(16, range=(1, None))
    max_len: int = field(128, range=(2, None))  # <= the model's max_position_embeddings
    group_size: int = field(8, range=(1, None))
    temperature: float = field(1.0, check=check_training_temperature)
    top_p: float = field(1.0, check=check_top_p)
    max_inflight_groups: int = field(8, range=(1, None))
    max_buffered: int = field(64, range=(1, None))  # async: pause new groups while this many trajectories wait
    engine_threads: int = field(1, range=(1, MAX_THREADS))
    routing: str = field("dp_aware", choices=ROUTINGS)
    virtual_nodes: int = field(150, range=(1, 1 << 16))
    imbalance_factor: float = field(1.5, range=(1.0, None))
    prefix_cache_entries: int = field(256, range=(0, None))  # per engine: trajectories whose KV is kept (0: none)
    prefix_cache_tokens: Optional[int] = field(None, range=(1, None))  # per engine: cached KV positions (None: any)
    episode_threads: int = field(64, range=(1, MAX_THREADS))
    # external engines (SGLang, glm5 serve): glm5 rl starts none and routes over these
    engine_urls: Optional[List[str]] = field(None, check=_check_engine_urls)
    api_key: Optional[str] = field(None, check=_check_api_key)  # bearer token the engines were started with
    weight_sync: str = field("disk", choices=WEIGHT_SYNCS)  # see rl/fleet/weight_sync.py
    flush_cache_on_sync: bool = field(True)
    sync_bucket_mb: float = field(64.0, range=(0, 1 << 16), open=("lo",))  # distributed: per update call
    sync_master_address: str = field("127.0.0.1")  # distributed: the trainer's address the engines connect to
    sync_backend: str = field("gloo", choices=SYNC_BACKENDS)
    devices: Any = field(None, check=_check_devices)  # spawned engines: "cuda:1,cuda:2" or a list (one, or one each)


@dataclasses.dataclass
class RLTrainConfig:
    batch_size: int = field(64, range=(1, None))
    max_staleness: Optional[int] = field(4, range=(0, None))
    teacher_checkpoint: Optional[str] = field(None, check=config_paths.input_dir)
    device: Optional[str] = field(None, check=_check_device)  # the trainer's device, e.g. "cuda:0" (None: default)
    max_idle_minutes: float = field(10.0, range=(0, None), open=("lo",))  # no batch for this long ends the run
    # the policy's forward uses the experts / DSA keys the engines used (they record and return them per sample)
    routing_replay: bool = field(False)
    index_replay: bool = field(False)
    optim: TrainerConfig = field(factory=TrainerConfig)


@dataclasses.dataclass
class EvalConfig:
    every: int = field(0, range=(0, None))  # trainer steps between evaluations (0: only at start and end)
    samples_per_problem: int = field(4, range=(1, None))


@dataclasses.dataclass
class RLConfig:
    seed: int = field(0, range=(0, MAX_SEED))
    mode: str = field("async", choices=MODES)
    executor: str = field("local", choices=EXECUTORS)
    output_dir: str = field("runs/rl", check=config_paths.output_dir)
    max_minutes: float = field(14.0, **positive())
    max_steps: int = field(1000, range=(1, None))
    torch_threads: int = field(1, range=(1, MAX_THREADS))
    env: Dict[str, Any] = field(factory=lambda: {"name": "arithmetic"})  # checked by the environment's signature
    model: Dict[str, Any] = field(factory=lambda: {"preset": "tiny", "overrides": {}})  # preset + GLM5Config fields
    rollout: RolloutConfig = field(factory=RolloutConfig)
    train: RLTrainConfig = field(factory=RLTrainConfig)
    eval: EvalConfig = field(factory=EvalConfig)

    def validate(self, source: str = "config") -> "RLConfig":
        """Raise ConfigError (every problem, one line) unless the fields and the rules between them hold."""
        problems = check(self) or self.rule_problems()
        if problems:
            raise ConfigError(problems, source)
        return self

    def model_config(self):
        """The GLM5Config of ``model`` (preset ``tiny`` + overrides); None for another preset (its architecture
        comes from ``--checkpoint``)."""
        from glm5_core.model import GLM5Config

        if self.model.get("preset", "tiny") != "tiny":
            return None
        return dataclasses.replace(GLM5Config.tiny(), **self.model.get("overrides", {}))

    def rule_problems(self) -> List[str]:
        problems = _model_problems(self) + _env_problems(self.env)
        if problems:
            return problems
        r, t = self.rollout, self.train
        if t.batch_size % r.group_size:
            problems.append(f"train.batch_size: expected a multiple of rollout.group_size={r.group_size}, "
                            f"got {t.batch_size}")
        if self.mode == "async" and r.max_buffered < t.batch_size:
            problems.append(f"rollout.max_buffered: expected >= train.batch_size={t.batch_size} (new groups pause "
                            f"at max_buffered waiting trajectories; the trainer waits for a full batch), "
                            f"got {r.max_buffered}")
        problems += _fleet_problems(r, t)
        if t.optim.distill_coef > 0 and not t.teacher_checkpoint:
            problems.append(f"train.optim.distill_coef: expected 0 without train.teacher_checkpoint (distillation "
                            f"needs a teacher), got {t.optim.distill_coef}")
        model = self.model_config()
        return problems or (self.size_problems(model) if model is not None else [])

    def size_problems(self, model) -> List[str]:
        """Problems of this run with policy architecture ``model`` (a GLM5Config: the preset's, or the one a
        ``--checkpoint`` holds): sequence length and the memory the run needs on this machine."""
        if self.rollout.max_len > model.max_position_embeddings:
            return [f"rollout.max_len: expected <= the model's max_position_embeddings="
                    f"{model.max_position_embeddings}, got {self.rollout.max_len}"]
        from glm5_core.rl.run_memory import memory_problems

        return memory_problems(self, model)


def _fleet_problems(r: RolloutConfig, t: RLTrainConfig) -> List[str]:
    """External engines, placement, and pushes the staleness bound can keep up with."""
    from glm5_core.rl.fleet.placement import engine_devices

    problems = []
    if r.engine_urls is not None and r.devices is not None:
        problems.append("rollout.devices: engines at rollout.engine_urls run where they were started; "
                        "remove rollout.devices")
    try:
        engine_devices(r.devices, r.num_engines)
    except ValueError as exc:
        problems.append(str(exc))
    for key, on in (("routing_replay", t.routing_replay), ("index_replay", t.index_replay)):
        if on and r.engine_urls is not None:
            problems.append(f"train.{key}: expected false with rollout.engine_urls (external engines' replay traces "
                            f"are not in the form the gateway reads: glm5 rl must start the engines), got true")
    if t.max_staleness is not None and t.optim.push_every > t.max_staleness + 1:
        problems.append(f"train.optim.push_every: expected <= train.max_staleness + 1 = {t.max_staleness + 1} "
                        f"(after the first push every sample would be too stale to train on; lower push_every or "
                        f"raise max_staleness), got {t.optim.push_every}")
    return problems


def _model_problems(cfg: RLConfig) -> List[str]:
    """``model``: ``preset`` (a string) and ``overrides`` (GLM5Config fields, checked by its declaration); the
    converted overrides replace the given ones."""
    from glm5_core.model import GLM5Config

    problems = [unknown_key("model.", str(k), ("preset", "overrides")) for k in cfg.model if k not in
                ("preset", "overrides")]
    preset, overrides = cfg.model.get("preset", "tiny"), cfg.model.get("overrides", {})
    if not isinstance(preset, str):
        problems.append(f"model.preset: expected a string ('tiny', or any name with --checkpoint), got {shown(preset)}")
    if not isinstance(overrides, dict):
        problems.append(f"model.overrides: expected a mapping of GLM5Config fields, got {shown(overrides)}")
    if problems:
        return problems
    converted = convert_fields(GLM5Config, overrides, "model.overrides.", problems, exclude=("extra",))
    if problems:
        return problems
    cfg.model = {**cfg.model, "overrides": converted}
    model = cfg.model_config()
    return model.problems("model.overrides.") if model is not None else []


def _environment_class(name: str):
    if name == "arithmetic":
        from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv

        return ArithmeticEnv
    from glm5_core.rl.rollout.envs.calculator import CalculatorEnv

    return CalculatorEnv


def _env_types(name: str) -> Dict[str, Any]:
    """Config key -> type of environment ``name``: its constructor's keyword arguments and ``byte_offset``."""
    cls = _environment_class(name)
    hints = typing.get_type_hints(cls.__init__)
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "codec", "seed")]
    return {**{p: hints[p] for p in params}, "byte_offset": int}


def _env_problems(env: Dict[str, Any]) -> List[str]:
    """``env``: ``name`` and the keys of that environment, typed by its constructor's signature; the constructor
    itself then checks their ranges (as the run will build it)."""
    from glm5_core.rl.rollout.envs.codec import ByteCodec

    name = env.get("name")
    known = _env_types(name) if name in ENVIRONMENTS else {k: t for e in ENVIRONMENTS for k, t in _env_types(e).items()}
    problems = [unknown_key("env.", str(key), [*known, "name"]) for key in env if key not in known and key != "name"]
    if name not in ENVIRONMENTS:
        hint = did_you_mean(name, ENVIRONMENTS) if isinstance(name, str) else ""
        problems.append(f"env.name: expected one of {', '.join(repr(e) for e in ENVIRONMENTS)}, "
                        f"got {shown(name)}{hint}")
    if problems:
        return problems
    values = {key: convert_value(f"env.{key}", value, known[key], problems) for key, value in env.items()
              if key != "name"}
    if problems:
        return problems
    try:
        _environment_class(name)(codec=ByteCodec(values.pop("byte_offset", 0)), **values)
    except (ValueError, TypeError) as exc:
        return [f"env.{exc}"]
    return []


def config_from_dict(data: Dict[str, Any], source: str = "config") -> RLConfig:
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping of sections at the top level, got {type(data).__name__}"], source)
    problems: List[str] = []
    cfg = build(RLConfig, data, "", problems)
    if problems:
        raise ConfigError(problems, source)
    problems = cfg.rule_problems()
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str, overrides: Optional[Dict[str, Any]] = None, sets: Sequence[str] = ()) -> RLConfig:
    """A YAML file (an empty one: every default), then ``--set KEY=VALUE`` overrides (VALUE read as YAML), then
    ``overrides`` (dotted key -> value, as command-line flags give them)."""
    data = apply_overrides(load_mapping(path, empty={}), sets)
    for key, value in (overrides or {}).items():
        assign(data, key, value)
    return config_from_dict(data, str(path))
