"""Typed run configuration of ``glm5 rl`` (YAML -> dataclasses declared with ``glm5_core.config_schema``).

Every field declares its type and range; :meth:`RLConfig.rule_problems` holds the rules between fields and the
``model`` and ``env`` sections (checked by GLM5Config's and the environment's own declarations). Every problem is
one line naming its full key. This module declares; the components read their sections. Loading a file, and the
checks against the policy's architecture and this machine's memory, are ``rl/config_loader``'s.

``rollout.temperature`` is the one sampling temperature of a run: the engines sample at it and the trainer
recomputes log-probs at it (there is no separate trainer temperature; ``train.optim.temperature`` is
rejected). It must be > 0: greedy rollouts record log-probs no policy ratio refers to."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from glm5_core import config_paths
from glm5_core.config_schema import (
    ConfigError,
    check,
    convert_fields,
    field,
    non_negative,
    positive,
    shown,
    unknown_key,
)
from glm5_core.device_kinds import DIST_BACKEND_NAMES
from glm5_core.train.config import CheckpointConfig

MODES = ("sync", "async")
EXECUTORS = ("local", "ray")
ROUTINGS = ("dp_aware", "round_robin")
MAX_SEED = 2 ** 53  # engine seeds are seed * 1000 + engine + 7919 * version: within torch's 64-bit seeds
MAX_THREADS = 4096
MAX_ENGINES = 1 << 20  # far above any fleet; the driver lists one entry per engine


TRUNCATION_POLICIES = ("as_is", "mask", "penalize")  # see rl/algorithm/truncation.py
WEIGHT_SYNCS = ("disk", "distributed")
SYNC_BACKENDS = DIST_BACKEND_NAMES  # the vendors' distributed backends (gloo, ...), read when a config is checked


def _check_temperature(value, key: str) -> None:
    from glm5_core.rl.serving.sampling import check_training_temperature

    check_training_temperature(value, key)


def _check_top_p(value, key: str) -> None:
    from glm5_core.rl.serving.sampling import check_top_p

    check_top_p(value, key)


def check_betas(betas, key: str) -> None:
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{key}: expected two values in [0, 1), got {list(betas)}")


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


def _check_speculative(setting, key: str) -> None:
    from glm5_core.rl.serving.speculative import parse_setting

    parse_setting(setting, key)


def _check_device(device, key: str) -> None:
    from glm5_core.rl.fleet.placement import parse_device

    parse_device(device, key)


# -- rollout.tokenizer (rl/rollout/run_codec.py) ----------------------------------------------------------------
def _check_tokenizer(path, key: str) -> None:
    from glm5_core.rl.rollout.run_codec import load_run_tokenizer

    config_paths.input_dir(path, key)
    load_run_tokenizer(path, key)


def _check_loss(value, key: str) -> None:
    from glm5_core.rl.algorithm.loss import resolve_loss

    resolve_loss(value, key)


def _check_advantage(value, key: str) -> None:
    from glm5_core.rl.algorithm.advantages import resolve_advantage

    resolve_advantage(value, key)


def _check_pass_k(values, key: str) -> None:
    if not values or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in values):
        raise ValueError(f"{key}: expected a non-empty list of ints >= 1, got {list(values)!r}")


@dataclasses.dataclass
class RolloutConfig:
    num_engines: int = field(1, range=(1, MAX_ENGINES))
    max_batch: int = field(16, range=(1, None))
    max_len: int = field(128, range=(2, None))  # <= the model's max_position_embeddings
    group_size: int = field(8, range=(1, None))
    temperature: float = field(1.0, check=_check_temperature)
    top_p: float = field(1.0, check=_check_top_p)
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
    # per-request sampling_seed (SGLang's field) from the run's seed: None sends it to spawned engines only
    # (an SGLang server may ignore or refuse it, see docs/rl-resume.md); true / false: to every engine / none
    sampling_seeds: Optional[bool] = field(None)
    weight_sync: str = field("disk", choices=WEIGHT_SYNCS)  # see rl/fleet/weight_sync.py
    flush_cache_on_sync: bool = field(True)
    sync_bucket_mb: float = field(64.0, range=(0, 1 << 16), open=("lo",))  # distributed: per update call
    sync_master_address: str = field("127.0.0.1")  # distributed: the trainer's address the engines connect to
    sync_backend: str = field("gloo", choices=SYNC_BACKENDS)
    devices: Any = field(None, check=_check_devices)  # spawned engines: "<type>:1,<type>:2" or a list
    # the environments' tokenizer: a tokenizer directory with a chat template (None: the byte codec)
    tokenizer: Optional[str] = field(None, check=_check_tokenizer)
    speculative: Optional[Dict[str, Any]] = field(None, check=_check_speculative)  # {draft_tokens: d}: MTP drafts


@dataclasses.dataclass
class TrainerConfig:
    """``train.optim`` of an RL config (read by ``rl/algorithm/trainer``); each field declares its own check
    (``glm5_core.config_schema``)."""

    lr: float = field(1e-4, **positive())
    weight_decay: float = field(0.0, **non_negative())
    betas: Tuple[float, float] = field((0.9, 0.99), check=check_betas)
    eps_low: float = field(0.2, range=(0.0, 1.0), open=("lo",))  # checked with the config, not at the first loss
    eps_high: float = field(0.28, **positive())
    micro_batch_size: int = field(16, range=(1, None))
    grad_clip: float = field(1.0, **non_negative())  # 0: no clipping
    push_every: int = field(1, range=(1, None))
    distill_coef: float = field(0.0, **non_negative())  # > 0 needs a teacher model
    # > 0: adds entropy_coef * (mean entropy of the policy at the sampled positions) to the objective, against
    # the policy collapsing onto one answer before it has learnt to read the prompt; 0: the loss alone
    entropy_coef: float = field(0.0, **non_negative())

    # keys that moved elsewhere (the config loader tells where instead of "unknown key")
    MOVED_KEYS: ClassVar[Dict[str, str]] = {
        "temperature": "the trainer recomputes log-probs at rollout.temperature (the importance ratio needs both "
                       "at one temperature); set rollout.temperature instead"}

    def validate(self) -> "TrainerConfig":
        problems = check(self, "train.optim.")
        if problems:
            raise ValueError(problems[0])
        return self


@dataclasses.dataclass
class RLTrainConfig:
    batch_size: int = field(64, range=(1, None))
    max_staleness: Optional[int] = field(4, range=(0, None))
    teacher_checkpoint: Optional[str] = field(None, check=config_paths.input_dir)
    device: Optional[str] = field(None, check=_check_device)  # the trainer's device, e.g. "<type>:0" (None: default)
    max_idle_minutes: float = field(10.0, range=(0, None), open=("lo",))  # no batch for this long ends the run
    # the policy's forward uses the experts / DSA keys the engines used (they record and return them per sample)
    routing_replay: bool = field(False)
    index_replay: bool = field(False)
    optim: TrainerConfig = field(factory=TrainerConfig)
    # plug-ins (rl/plugins.py): a built-in name or an import path 'pkg.module:name', checked at start
    loss: str = field("double_sided_is", check=_check_loss)
    advantage: str = field("group_normalized", check=_check_advantage)
    # a trajectory cut by rollout.max_len: trained as it is, masked out of the loss, or given truncation_reward
    truncation: str = field("as_is", choices=TRUNCATION_POLICIES)
    truncation_reward: float = field(-1.0)


@dataclasses.dataclass
class EvalConfig:
    """Held-out evaluation (the environment's eval set, see rl/evaluation.py): at start, every ``every`` steps
    and at the end."""

    every: int = field(0, range=(0, None))  # trainer steps between evaluations (0: only at start and end)
    samples_per_problem: int = field(4, range=(1, None))  # n of pass@k, sampled at rollout.temperature
    pass_k: List[int] = field(factory=lambda: [1], check=_check_pass_k)  # each k <= samples_per_problem
    greedy: bool = field(True)  # also one greedy (temperature 0) answer per problem
    correct_reward: float = field(1.0)  # a sample counts as correct (pass@k, accuracy) when its reward >= this


@dataclasses.dataclass
class DynamicSamplingConfig:
    """DAPO / slime dynamic sampling (rl/algorithm/dynamic_sampling.py): groups whose rewards are all equal
    are dropped and more groups are sampled to keep the batch full, for at most ``max_rounds`` rollout rounds
    a batch (async: a round is a batch's worth of finished groups); then equal-reward groups fill it."""

    enabled: bool = field(False)
    max_rounds: int = field(4, range=(1, 1000))


@dataclasses.dataclass
class RLCheckpointConfig(CheckpointConfig):
    """``checkpoint`` of an RL config: a resume point every ``every_steps`` trainer steps and at the end (read by
    ``rl/run_state``)."""

    every_steps: int = field(10, **non_negative())  # 0: only at the end of the run


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
    checkpoint: RLCheckpointConfig = field(factory=RLCheckpointConfig)  # resume points (glm5 rl --resume)
    dynamic_sampling: DynamicSamplingConfig = field(factory=DynamicSamplingConfig)
    reward: Optional[Dict[str, Any]] = field(None)  # {path: ...} or {url: ...}: see rl/rollout/rewards.py

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
        problems = _model_problems(self) + _env_problems(self.env) + _plugin_problems(self)
        if problems:
            return problems
        problems = _env_tokenizer_problems(self)
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
        return problems


def _plugin_problems(cfg: "RLConfig") -> List[str]:
    """``reward``, and the rules between dynamic sampling, evaluation and the rollout."""
    from glm5_core.rl.rollout.rewards import reward_problems

    problems = reward_problems(cfg.reward)
    if cfg.dynamic_sampling.enabled and cfg.rollout.group_size < 2:
        problems.append(f"dynamic_sampling.enabled: expected rollout.group_size >= 2 (a group of one always has "
                        f"equal rewards, so every group would be dropped), got group_size={cfg.rollout.group_size}")
    n = cfg.eval.samples_per_problem
    problems += [f"eval.pass_k: expected each k <= eval.samples_per_problem={n} (pass@k estimates from n samples), "
                 f"got {k}" for k in cfg.eval.pass_k if k > n]
    return problems


def _fleet_problems(r: RolloutConfig, t: RLTrainConfig) -> List[str]:
    """External engines, placement, and pushes the staleness bound can keep up with."""
    from glm5_core.rl.fleet.placement import check_engine_devices

    problems = []
    if r.engine_urls is not None and r.devices is not None:
        problems.append("rollout.devices: engines at rollout.engine_urls run where they were started; "
                        "remove rollout.devices")
    try:
        check_engine_devices(r.devices, r.num_engines)  # builds nothing of num_engines' size
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


def _env_problems(env: Dict[str, Any]) -> List[str]:
    """``env``: a built-in ``name`` or a plug-in ``path`` and the keys of that environment (see
    ``rl/rollout/envs/registry``)."""
    from glm5_core.rl.rollout.envs.registry import env_problems

    return env_problems(env)


def _env_tokenizer_problems(cfg: RLConfig) -> List[str]:
    """An environment that talks chat (the OpenAI proxy's, ``env.name: openai_agent``) needs ``rollout.tokenizer``."""
    from glm5_core.rl.rollout.envs.registry import needs_chat_template

    if cfg.rollout.tokenizer is None and needs_chat_template(cfg.env):
        what = cfg.env.get("name") or cfg.env.get("path")
        return [f"rollout.tokenizer: env {what!r} needs a tokenizer directory with a chat template (its agents' "
                f"chat requests are rendered by it), got null"]
    return []
