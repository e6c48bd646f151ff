"""An RL config from YAML: the declarations of ``rl/config`` built and checked (the schema pass), then the checks
that need a component (the second pass: ``rollout.tokenizer`` loaded, the ``train.loss`` / ``train.advantage``
plug-ins resolved, the ``env`` and ``reward`` sections built on paper), then the run checked against the policy's
architecture and this machine's memory (``rl/run_memory``) before anything is built. ``rl/config`` is a leaf that
every layer reads; the checks that read a layer live here, at the top.

Every problem is one line naming its full key; all of them are raised together as one :class:`ConfigError`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from glm5_core import config_paths
from glm5_core.config_schema import ConfigError, build, check
from glm5_core.config_yaml import load_config_file
from glm5_core.rl.algorithm.advantages import resolve_advantage
from glm5_core.rl.algorithm.loss import resolve_loss
from glm5_core.rl.config import RLConfig
from glm5_core.rl.rollout.envs.registry import env_problems, needs_chat_template
from glm5_core.rl.rollout.rewards import reward_problems
from glm5_core.rl.rollout.run_codec import load_run_tokenizer
from glm5_core.rl.run_memory import memory_problems


def _load_tokenizer(path: str, key: str) -> None:
    """``rollout.tokenizer`` loads, with a chat template (a missing folder is the schema pass's problem)."""
    try:
        config_paths.input_dir(path, key)
    except (ValueError, TypeError):
        return
    load_run_tokenizer(path, key)


# (section, field, check(value, key)): the fields whose check needs a component, run where the schema pass
# accepted the value's type (a string)
COMPONENT_FIELDS = (("rollout", "tokenizer", _load_tokenizer), ("train", "loss", resolve_loss),
                    ("train", "advantage", resolve_advantage))


def component_field_problems(values: dict[str, Any]) -> list[str]:
    """The second pass: the problems of :data:`COMPONENT_FIELDS` in ``values`` (parsed YAML, or a config's
    sections as mappings)."""
    problems = []
    for section, name, rule in COMPONENT_FIELDS:
        given = values.get(section)
        value = given.get(name) if isinstance(given, dict) else None
        if isinstance(value, str):
            try:
                rule(value, f"{section}.{name}")
            except (ValueError, TypeError) as exc:
                problems.append(str(exc))
    return problems


def rule_problems(cfg: RLConfig) -> list[str]:
    """The rules between sections: ``model``, ``env`` (the environment's declaration), ``reward``, dynamic sampling
    and evaluation; then the chat template an environment needs; then the run's sizes and fleet."""
    problems = cfg.model_problems() + env_problems(cfg.env) + reward_problems(cfg.reward) + cfg.sampling_problems()
    if problems:
        return problems
    return _env_tokenizer_problems(cfg) or cfg.run_problems()


def _env_tokenizer_problems(cfg: RLConfig) -> list[str]:
    """An environment that talks chat (the OpenAI proxy's, ``env.name: openai_agent``) needs ``rollout.tokenizer``."""
    if cfg.rollout.tokenizer is None and needs_chat_template(cfg.env):
        what = cfg.env.get("name") or cfg.env.get("path")
        return [f"rollout.tokenizer: env {what!r} needs a tokenizer directory with a chat template (its agents' "
                f"chat requests are rendered by it), got null"]
    return []


def check_config(cfg: RLConfig, source: str = "config") -> RLConfig:
    """:meth:`RLConfig.validate` of a config built in code, with the checks that need a component: raise
    ConfigError (every problem, one line) unless they all hold."""
    sections = {"rollout": {"tokenizer": cfg.rollout.tokenizer},
                "train": {"loss": cfg.train.loss, "advantage": cfg.train.advantage}}
    problems = (check(cfg) + component_field_problems(sections)) or rule_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def size_problems(cfg: RLConfig, model) -> list[str]:
    """Problems of run ``cfg`` with policy architecture ``model`` (a GLM5Config: the preset's, or the one a
    ``--checkpoint`` holds): sequence length, MTP drafts, the codec's vocabulary and the memory the run needs
    on this machine."""
    from glm5_core.train.config import parallel_problems

    parallel = parallel_problems(cfg.parallel, model.n_routed_experts)
    if parallel:
        return parallel
    if cfg.rollout.max_len > model.max_position_embeddings:
        return [f"rollout.max_len: expected <= the model's max_position_embeddings="
                f"{model.max_position_embeddings}, got {cfg.rollout.max_len}"]
    if cfg.rollout.speculative is not None and not model.num_nextn_predict_layers:
        return ["rollout.speculative: expected a model with MTP weights (num_nextn_predict_layers > 0) to draft "
                "with, got a model without"]
    return _codec_problems(cfg, model.vocab_size) or memory_problems(cfg, model)


def _codec_problems(cfg: RLConfig, vocab_size: int) -> list[str]:
    """The environments' codec (``rollout.tokenizer``, else bytes at ``env.byte_offset``) fits ``vocab_size``."""
    from glm5_core.rl.rollout.run_codec import TOKENIZER_KEY, run_codec, vocab_problem

    path = cfg.rollout.tokenizer
    if path is not None and "byte_offset" in cfg.env:
        return [f"env.byte_offset: the byte codec's offset, unused with {TOKENIZER_KEY}; remove env.byte_offset"]
    try:
        codec = run_codec(path, cfg.env.get("byte_offset", 0))
    except ValueError as exc:
        return [str(exc)]
    problem = vocab_problem(codec, vocab_size, TOKENIZER_KEY if path is not None else "env.byte_offset")
    return [problem] if problem else []


def config_from_dict(data: dict[str, Any], source: str = "config") -> RLConfig:
    """The config of parsed YAML ``data``: its fields, the rules between them, and (for a ``model.preset``
    architecture) :func:`size_problems`; raises :class:`ConfigError` listing the problems."""
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping of sections at the top level, got {type(data).__name__}"], source)
    problems: list[str] = []
    cfg = build(RLConfig, data, "", problems)
    problems += component_field_problems(data)
    if problems:
        raise ConfigError(problems, source)
    problems = rule_problems(cfg)
    if not problems:
        model = cfg.model_config()
        problems = size_problems(cfg, model) if model is not None else []
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str, sets: Sequence[str] = (), values: Optional[dict[str, Any]] = None) -> RLConfig:
    """A YAML file (an empty one: every default), then ``--set KEY=VALUE`` overrides ``sets`` (VALUE read as
    YAML), then ``values`` (dotted key -> value, as command-line flags give them)."""
    return load_config_file(path, sets, values, config_from_dict, empty={})
