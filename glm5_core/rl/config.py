"""Typed run configuration of ``glm5 rl`` (YAML -> dataclasses declared with ``glm5_core.config_schema``).

Every field declares its type and range; :meth:`RLConfig.rule_problems` holds the rules between fields and the
``model`` section (checked by GLM5Config's own declaration). Every problem is one line naming its full key. This
module declares; the components read their sections. It is a leaf of ``rl``: it imports no other rl module, so
every layer may read it, and the value checks every layer shares (temperature, top-p, engine URLs, device strings,
the speculative setting) live here. Loading a file, the checks that need a component (the environment, the reward,
the tokenizer, the loss and advantage plug-ins) and the checks against the policy's architecture and this
machine's memory are ``rl/config_loader``'s.

``rollout.temperature`` is the one sampling temperature of a run: the engines sample at it and the trainer
recomputes log-probs at it (there is no separate trainer temperature; ``train.optim.temperature`` is
rejected). It must be > 0: greedy rollouts record log-probs no policy ratio refers to."""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import urllib.parse
from typing import Any, ClassVar, Optional

from glm5_core import config_paths, device_kinds
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
from glm5_core.device_facts import DeviceFacts
from glm5_core.device_kinds import DIST_BACKEND_NAMES
from glm5_core.train.config import CheckpointConfig, ParallelConfig

MODES = ("sync", "async")
EXECUTORS = ("local", "ray")
ROUTINGS = ("dp_aware", "round_robin")
MAX_SEED = 2 ** 53  # engine seeds are seed * 1000 + engine + 7919 * version: within torch's 64-bit seeds
MAX_THREADS = 4096
MAX_ENGINES = 1 << 20  # far above any fleet; the driver lists one entry per engine


ADMISSIONS = ("slots", "staleness")  # see rl/algorithm/buffer.py (try_admit)
TRUNCATION_POLICIES = ("as_is", "mask", "penalize")  # see rl/algorithm/truncation.py
WEIGHT_SYNCS = ("disk", "distributed")
SYNC_BACKENDS = DIST_BACKEND_NAMES  # the vendors' distributed backends (gloo, ...), read when a config is checked


# -- values every layer checks (the engines, the fleet and the trainer import them from here) ----------------------
GREEDY_BELOW = 1e-6  # temperatures under this decode greedily (as SGLang does): logits / 1e-39 would overflow
MAX_DRAFT_TOKENS = 16  # MTP drafts per decode step (rl/serving/speculative.py)
_DEVICE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::(\d{1,4}(?:-\d{1,4})?(?:\+\d{1,4}(?:-\d{1,4})?)*))?")
_CORE_SET_SIZE = 4096  # cores one host-device set may name (a guard against "cpu:0-9999")


def check_training_temperature(temperature, name: str = "rollout.temperature") -> float:
    """A sampling temperature whose recorded log-probs the trainer can reproduce: a finite float >= GREEDY_BELOW.

    Temperature 0 (greedy) records temperature-1 log-probs of an argmax, which no policy ratio refers to."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < GREEDY_BELOW:
        raise ValueError(f"{name}: expected a finite number >= {GREEDY_BELOW} for training rollouts (greedy "
                         f"decoding, temperature 0, is for evaluation only), got {temperature!r}")
    return float(temperature)


def check_top_p(top_p, name: str = "top_p") -> float:
    """A nucleus mass the engines accept: a number in (0, 1] (1 keeps the whole vocabulary)."""
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"{name}: expected a number in (0, 1], got {top_p!r}")
    return float(top_p)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_engine_url(url: Any, *, allow_remote: bool, where: str = "url") -> str:
    """``url`` without a trailing slash; ``ValueError`` naming ``where`` unless it is ``http://HOST:PORT`` with a
    loopback host (any host when ``allow_remote``)."""
    if not isinstance(url, str):
        raise ValueError(f"{where}: expected an http://HOST:PORT address, got {url!r:.80}")
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.username is not None or parsed.password is not None or parsed.fragment:
        shown = parsed._replace(netloc=f"***@{parsed.netloc.rpartition('@')[2]}" if "@" in parsed.netloc
                                else parsed.netloc).geturl()  # the credentials are not repeated into logs
        raise ValueError(f"{where}: expected no credentials or fragment in the URL (use rollout.api_key), "
                         f"got {shown!r:.80}")
    if parsed.scheme != "http" or not parsed.hostname or port is None or parsed.path.strip("/") or parsed.query:
        raise ValueError(f"{where}: expected an http://HOST:PORT address, got {url!r:.80}")
    if not allow_remote and not is_loopback(parsed.hostname):
        raise ValueError(f"{where}: {parsed.hostname!r} is not a loopback host; list remote engines explicitly "
                         f"(rollout.engine_urls or --engine-url), got {url!r:.80}")
    return url.rstrip("/")


def _examples(kinds: dict[str, DeviceFacts]) -> str:
    shown = [f"'{kind}'" if facts.is_host else f"'{kind}:0'" for kind, facts in kinds.items()]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _list_example(kinds: dict[str, DeviceFacts]) -> str:
    kind = next((k for k, facts in kinds.items() if not facts.is_host), next(iter(kinds)))
    return f"'{kind}:1,{kind}:2'"


def _split_device(text: Any, where: str) -> tuple[str, Optional[str]]:
    kinds = device_kinds.device_types()
    match = _DEVICE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or match.group(1) not in kinds:
        raise ValueError(f"{where}: expected a device such as {_examples(kinds)}, got {text!r:.80}")
    kind, suffix = match.group(1), match.group(2)
    if not kinds[kind].is_host and (suffix is None or not suffix.isdigit()):
        raise ValueError(f"{where}: expected an index for {kind} (e.g. '{kind}:0'; core sets such as "
                         f"'<host>:0-3' are for the host device only), got {text!r:.80}")
    return kind, suffix


def parse_device(text: Any, where: str) -> tuple[str, Optional[int]]:
    """``"<type>:1"`` -> ``("<type>", 1)``; ``"cpu"`` -> ``("cpu", None)``; ``ValueError`` naming ``where``.
    The host device (the vendor facts' ``is_host``) also takes a core set, ``"cpu:0-1"`` / ``"cpu:0-1+4"``
    (see :func:`core_set`): its index is the set's first core. The device types are the vendors'
    (:func:`glm5_core.device_kinds.device_types`), read at each call."""
    kind, suffix = _split_device(text, where)
    cores = core_set(text, where)
    if cores is not None:
        return kind, cores[0]
    return kind, None if suffix is None else int(suffix)


def core_set(text: Any, where: str) -> Optional[tuple[int, ...]]:
    """The CPU cores a host-device entry pins its process to, sorted, or None (an accelerator, or the bare host
    device: no pinning). ``"cpu:2"`` -> ``(2,)``, ``"cpu:0-3"`` -> ``(0, 1, 2, 3)``, ``"cpu:0-1+6"`` ->
    ``(0, 1, 6)``: Linux cpu-list ranges joined by ``+`` (taskset's ``,`` separates the entries of
    ``rollout.devices`` already). ``ValueError`` naming ``where`` for an empty or reversed range."""
    kind, suffix = _split_device(text, where)
    if suffix is None or not device_kinds.device_types()[kind].is_host:
        return None
    cores: set[int] = set()
    for part in suffix.split("+"):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first or last - first >= _CORE_SET_SIZE:
            raise ValueError(f"{where}: expected a core range low-high with low <= high (at most {_CORE_SET_SIZE} "
                             f"cores), got {text!r:.80}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def _normal(kind: str, index: Optional[int], cores: Optional[tuple[int, ...]]) -> str:
    if cores is not None and len(cores) > 1:
        return f"{kind}:" + "+".join(f"{a}-{b}" if a != b else f"{a}" for a, b in _runs(cores))
    return kind if index is None else f"{kind}:{index}"


def _runs(cores: tuple[int, ...]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return runs


def parse_devices(value: Any, where: str) -> list[str]:
    """A list of devices from ``"<type>:1,<type>:2"`` or ``["<type>:1", "<type>:2"]`` (normalised, checked)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{where}: expected devices such as {_list_example(device_kinds.device_types())} or a "
                         f"list of them, got {value!r:.80}")
    out = []
    for i, item in enumerate(items):
        kind, index = parse_device(item, f"{where}[{i}]")
        out.append(_normal(kind, index, core_set(item, f"{where}[{i}]")))
    return out


def torch_device_name(device: str, where: str = "device") -> str:
    """The torch device of a device entry: the host device's core set is a placement, not a torch index."""
    kind, index = parse_device(device, where)
    if device_kinds.device_types()[kind].is_host:
        return kind
    return f"{kind}:{index}"


def check_core_sets(train_device: Optional[str], engine_devices: Optional[Any]) -> None:
    """``ValueError`` when the core sets of ``train.device`` and ``rollout.devices`` overlap (one entry shared by
    all engines is one set): pinned roles never share a core."""
    named: list[tuple[str, tuple[int, ...]]] = []
    if train_device is not None:
        cores = core_set(train_device, "train.device")
        if cores is not None:
            named.append(("train.device", cores))
    if engine_devices is not None:
        for i, device in enumerate(parse_devices(engine_devices, "rollout.devices")):
            cores = core_set(device, f"rollout.devices[{i}]")
            if cores is not None:
                named.append((f"rollout.devices[{i}]", cores))
    for a in range(len(named)):
        for b in range(a + 1, len(named)):
            shared = sorted(set(named[a][1]) & set(named[b][1]))
            if shared:
                raise ValueError(f"{named[b][0]}: expected CPU cores no other role is pinned to, got cores "
                                 f"{shared} also in {named[a][0]}")


def check_engine_devices(devices: Optional[Any], num_engines: int, where: str = "rollout.devices") -> None:
    """ValueError naming ``where`` unless ``devices`` gives one device per engine, one for all, or None; nothing
    of ``num_engines``' size is built (a config is checked with this before its sizes are)."""
    if devices is None:
        return
    parsed = parse_devices(devices, where)
    if len(parsed) not in (1, num_engines):
        raise ValueError(f"{where}: expected one device per engine (rollout.num_engines={num_engines}) or one for "
                         f"all, got {len(parsed)}: {','.join(parsed)}")


def parse_setting(setting, key: str = "speculative") -> Optional[int]:
    """``speculative`` engine setting -> draft tokens per step, or None (off). Expected None or
    ``{"draft_tokens": d}`` with an int d in [1, MAX_DRAFT_TOKENS]."""
    if setting is None:
        return None
    if not isinstance(setting, dict) or set(setting) != {"draft_tokens"}:
        raise ValueError(f"{key}: expected null or {{draft_tokens: d}}, got {setting!r:.120}")
    d = setting["draft_tokens"]
    if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DRAFT_TOKENS:
        raise ValueError(f"{key}.draft_tokens: expected an int in [1, {MAX_DRAFT_TOKENS}], got {d!r:.80}")
    return d


# -- the fields' own checks ---------------------------------------------------------------------------------------
def check_betas(betas, key: str) -> None:
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{key}: expected two values in [0, 1), got {list(betas)}")


def _check_engine_urls(urls, key: str) -> None:
    if not urls:
        raise ValueError(f"{key}: expected a non-empty list of http://HOST:PORT, got []")
    for i, url in enumerate(urls):
        check_engine_url(url, allow_remote=True, where=f"{key}[{i}]")


def _check_api_key(key_value, key: str) -> None:
    if not key_value:
        raise ValueError(f"{key}: expected a non-empty string or null, got ''")


def _check_devices(devices, key: str) -> None:
    if devices is not None:
        parse_devices(devices, key)


def _check_mask_offpolicy(value, key: str) -> None:
    if value is None or value == "partial" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    raise ValueError(f"{key}: expected null, 'partial' or an int >= 0 (versions), got {value!r:.60}")


def _check_pass_k(values, key: str) -> None:
    if not values or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in values):
        raise ValueError(f"{key}: expected a non-empty list of ints >= 1, got {list(values)!r}")


@dataclasses.dataclass
class RolloutConfig:
    num_engines: int = field(1, range=(1, MAX_ENGINES))
    max_batch: int = field(16, range=(1, None))
    max_len: int = field(128, range=(2, None))  # <= the model's max_position_embeddings
    group_size: int = field(8, range=(1, None))
    temperature: float = field(1.0, check=check_training_temperature)
    top_p: float = field(1.0, check=check_top_p)
    max_inflight_groups: int = field(8, range=(1, None))
    max_buffered: int = field(64, range=(1, None))  # async: pause new groups while this many trajectories wait
    # async: "slots" starts a group whenever an in-flight slot is free (samples too stale are dropped at take
    # time); "staleness" (AReaL's staleness manager) starts one only if it can be trained within
    # train.max_staleness versions of the weights it starts under, so no admitted group is dropped as stale
    admission: str = field("slots", choices=ADMISSIONS)
    engine_threads: int = field(1, range=(1, MAX_THREADS))
    routing: str = field("dp_aware", choices=ROUTINGS)
    virtual_nodes: int = field(150, range=(1, 1 << 16))
    imbalance_factor: float = field(1.5, range=(1.0, None))
    prefix_cache_entries: int = field(256, range=(0, None))  # per engine: trajectories whose KV is kept (0: none)
    prefix_cache_tokens: Optional[int] = field(None, range=(1, None))  # per engine: cached KV positions (None: any)
    episode_threads: int = field(64, range=(1, MAX_THREADS))
    # external engines (SGLang, glm5 serve): glm5 rl starts none and routes over these
    engine_urls: Optional[list[str]] = field(None, check=_check_engine_urls)
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
    tokenizer: Optional[str] = field(None, check=config_paths.input_dir)  # loaded by rl/config_loader
    speculative: Optional[dict[str, Any]] = field(None, check=parse_setting)  # {draft_tokens: d}: MTP drafts


@dataclasses.dataclass
class TrainerConfig:
    """``train.optim`` of an RL config (read by ``rl/algorithm/trainer``); each field declares its own check
    (``glm5_core.config_schema``)."""

    lr: float = field(1e-4, **positive())
    weight_decay: float = field(0.0, **non_negative())
    betas: tuple[float, float] = field((0.9, 0.99), check=check_betas)
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
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "temperature": "the trainer recomputes log-probs at rollout.temperature (the importance ratio needs both "
                       "at one temperature); set rollout.temperature instead"}

    def validate(self) -> TrainerConfig:
        problems = check(self, "train.optim.")
        if problems:
            raise ValueError(problems[0])
        return self


@dataclasses.dataclass
class RLTrainConfig:
    batch_size: int = field(64, range=(1, None))
    max_staleness: Optional[int] = field(4, range=(0, None))
    teacher_checkpoint: Optional[str] = field(None, check=config_paths.input_dir)
    device: Optional[str] = field(None, check=parse_device)  # the trainer's device, e.g. "<type>:0" (None: default)
    max_idle_minutes: float = field(10.0, range=(0, None), open=("lo",))  # no batch for this long ends the run
    # the policy's forward uses the experts / DSA keys the engines used (they record and return them per sample)
    routing_replay: bool = field(False)
    index_replay: bool = field(False)
    optim: TrainerConfig = field(factory=TrainerConfig)
    # plug-ins (rl/plugins.py): a built-in name or an import path 'pkg.module:name', resolved by rl/config_loader
    loss: str = field("double_sided_is")
    advantage: str = field("group_normalized")
    # a trajectory cut by rollout.max_len: trained as it is, masked out of the loss, or given truncation_reward
    truncation: str = field("as_is", choices=TRUNCATION_POLICIES)
    truncation_reward: float = field(-1.0)
    # partial rollout (slime's --mask-offpolicy-in-partial-rollout): null trains every sampled token; "partial"
    # masks a trajectory's tokens sampled under older weights than its newest (those from before a push it
    # lived through); an int X masks tokens sampled more than X versions behind the policy being trained
    mask_offpolicy: Any = field(None, check=_check_mask_offpolicy)


@dataclasses.dataclass
class EvalConfig:
    """Held-out evaluation (the environment's eval set, see rl/evaluation.py): at start, every ``every`` steps
    and at the end."""

    every: int = field(0, range=(0, None))  # trainer steps between evaluations (0: only at start and end)
    samples_per_problem: int = field(4, range=(1, None))  # n of pass@k, sampled at rollout.temperature
    pass_k: list[int] = field(factory=lambda: [1], check=_check_pass_k)  # each k <= samples_per_problem
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
    env: dict[str, Any] = field(factory=lambda: {"name": "arithmetic"})  # checked by the environment's signature
    model: dict[str, Any] = field(factory=lambda: {"preset": "tiny", "overrides": {}})  # preset + GLM5Config fields
    rollout: RolloutConfig = field(factory=RolloutConfig)
    train: RLTrainConfig = field(factory=RLTrainConfig)
    eval: EvalConfig = field(factory=EvalConfig)
    checkpoint: RLCheckpointConfig = field(factory=RLCheckpointConfig)  # resume points (glm5 rl --resume)
    dynamic_sampling: DynamicSamplingConfig = field(factory=DynamicSamplingConfig)
    reward: Optional[dict[str, Any]] = field(None)  # {path: ...} or {url: ...}: see rl/rollout/rewards.py
    # the policy trainer's layout, as glm5 pretrain's (train/config.ParallelConfig; --parallel ep=N): see rl/policy.py
    parallel: ParallelConfig = field(factory=ParallelConfig)

    def validate(self, source: str = "config") -> RLConfig:
        """Raise ConfigError (every problem, one line) unless the fields and the rules between them hold (this
        module's checks; ``rl/config_loader.check_config`` adds the ones that need a component)."""
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

    def rule_problems(self) -> list[str]:
        """The rules between fields this module can check alone (the ones that need a component, the environment,
        the reward, the tokenizer and the plug-ins, are ``rl/config_loader.rule_problems``'s)."""
        return self.model_problems() + self.sampling_problems() or self.run_problems()

    def model_problems(self) -> list[str]:
        """``model``: ``preset`` (a string) and ``overrides`` (GLM5Config fields, checked by its declaration); the
        converted overrides replace the given ones."""
        from glm5_core.model import GLM5Config

        problems = [unknown_key("model.", str(k), ("preset", "overrides")) for k in self.model if k not in
                    ("preset", "overrides")]
        preset, overrides = self.model.get("preset", "tiny"), self.model.get("overrides", {})
        if not isinstance(preset, str):
            problems.append(f"model.preset: expected a string ('tiny', or any name with --checkpoint), "
                            f"got {shown(preset)}")
        if not isinstance(overrides, dict):
            problems.append(f"model.overrides: expected a mapping of GLM5Config fields, got {shown(overrides)}")
        if problems:
            return problems
        converted = convert_fields(GLM5Config, overrides, "model.overrides.", problems, exclude=("extra",))
        if problems:
            return problems
        self.model = {**self.model, "overrides": converted}
        model = self.model_config()
        return model.problems("model.overrides.") if model is not None else []

    def sampling_problems(self) -> list[str]:
        """The rules between dynamic sampling, evaluation and the rollout."""
        problems = []
        if self.dynamic_sampling.enabled and self.rollout.group_size < 2:
            problems.append(f"dynamic_sampling.enabled: expected rollout.group_size >= 2 (a group of one always has "
                            f"equal rewards, so every group would be dropped), got "
                            f"group_size={self.rollout.group_size}")
        n = self.eval.samples_per_problem
        problems += [f"eval.pass_k: expected each k <= eval.samples_per_problem={n} (pass@k estimates from n "
                     f"samples), got {k}" for k in self.eval.pass_k if k > n]
        return problems

    def run_problems(self) -> list[str]:
        """Batch and buffer sizes, the fleet, and distillation."""
        problems = []
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


def _fleet_problems(r: RolloutConfig, t: RLTrainConfig) -> list[str]:
    """External engines, placement, and pushes the staleness bound can keep up with."""
    problems = []
    if r.engine_urls is not None and r.devices is not None:
        problems.append("rollout.devices: engines at rollout.engine_urls run where they were started; "
                        "remove rollout.devices")
    try:
        check_engine_devices(r.devices, r.num_engines)  # builds nothing of num_engines' size
        check_core_sets(t.device, r.devices)
    except ValueError as exc:
        problems.append(str(exc))
    if r.admission == "staleness" and t.max_staleness is None:
        problems.append("rollout.admission: 'staleness' paces admission by train.max_staleness; set it, or use "
                        "rollout.admission: slots")
    if t.max_staleness is not None and t.optim.push_every > t.max_staleness + 1:
        problems.append(f"train.optim.push_every: expected <= train.max_staleness + 1 = {t.max_staleness + 1} "
                        f"(after the first push every sample would be too stale to train on; lower push_every or "
                        f"raise max_staleness), got {t.optim.push_every}")
    return problems
