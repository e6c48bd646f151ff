"""Which environment a run builds: ``env: {name: arithmetic | calculator | openai_agent, ...}`` (built-in) or
``env: {path: "pkg.module:factory", ...}`` (a plug-in).

The other keys of ``env`` are keyword arguments of the environment's constructor (a plug-in: its factory),
typed by its signature and annotations; ``codec`` (from ``byte_offset``) and ``seed`` are passed by the run
when the constructor takes them. :func:`env_problems` checks all of it at config time, one line a problem,
by building the environment once as the run will; :func:`build_env` builds it for the run.
"""
from __future__ import annotations

import inspect
import typing
from typing import Any, Callable

from glm5_core.config_schema import convert_value, did_you_mean, shown, unknown_key
from glm5_core.rl.plugins import load_object
from glm5_core.rl.rollout.envs.base import Environment
from glm5_core.rl.rollout.envs.codec import ByteCodec

BUILTIN_ENVIRONMENTS = ("arithmetic", "calculator", "openai_agent")
RUN_ARGUMENTS = ("codec", "seed")  # passed by the run, not set in the config


def builtin_environment(name: str) -> Callable[..., Environment]:
    """The class of a built-in environment; ValueError naming the choices for any other name."""
    if name == "arithmetic":
        from glm5_core.rl.rollout.envs.arithmetic import ArithmeticEnv

        return ArithmeticEnv
    if name == "calculator":
        from glm5_core.rl.rollout.envs.calculator import CalculatorEnv

        return CalculatorEnv
    if name == "openai_agent":
        from glm5_core.rl.rollout.envs.openai_agent import OpenAIAgentEnv

        return OpenAIAgentEnv
    hint = did_you_mean(name, BUILTIN_ENVIRONMENTS) if isinstance(name, str) else ""
    raise ValueError(f"env.name: expected one of {', '.join(repr(e) for e in BUILTIN_ENVIRONMENTS)}, got "
                     f"{shown(name)}{hint} (a plug-in: env.path, an import path 'pkg.module:factory')")


def environment_factory(env_cfg: dict[str, Any]) -> Callable[..., Environment]:
    """The constructor ``env`` names (``name`` or ``path``, exactly one)."""
    if "name" in env_cfg and "path" in env_cfg:
        raise ValueError(f"env: expected 'name' (a built-in) or 'path' (a plug-in), not both; got name="
                         f"{shown(env_cfg['name'])} and path={shown(env_cfg['path'])}")
    if "path" in env_cfg:
        factory = load_object(env_cfg["path"], "env.path")
        if not callable(factory):
            raise ValueError(f"env.path: {env_cfg['path']!r} names a {type(factory).__name__}, expected a "
                             f"callable returning an Environment")
        return factory
    return builtin_environment(env_cfg.get("name"))


def _signature_target(factory: Callable) -> Callable:
    return factory.__init__ if inspect.isclass(factory) else factory


def _parameters(factory: Callable) -> dict[str, inspect.Parameter]:
    params = inspect.signature(_signature_target(factory)).parameters
    return {n: p for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _takes_any_keyword(factory: Callable) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(_signature_target(factory)).parameters.values())


def _config_keys(factory: Callable) -> dict[str, Any]:
    """Config key -> type (``Any`` where not annotated) of ``factory``'s keyword arguments."""
    try:
        hints = typing.get_type_hints(_signature_target(factory))
    except Exception:  # a plug-in's annotations that do not resolve: take its values as they come
        hints = {}
    keys = {n: hints.get(n, Any) for n in _parameters(factory) if n not in RUN_ARGUMENTS}
    if "codec" in _parameters(factory):
        keys["byte_offset"] = int
    return keys


def _converted_kwargs(factory: Callable, env_cfg: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    known = _config_keys(factory)
    values = {k: v for k, v in env_cfg.items() if k not in ("name", "path")}
    if not _takes_any_keyword(factory):
        problems += [unknown_key("env.", str(k), [*known, "name" if "name" in env_cfg else "path"])
                     for k in values if k not in known]
    required = [n for n, p in _parameters(factory).items() if p.default is p.empty and n not in RUN_ARGUMENTS]
    problems += [f"env.{n}: required by {env_cfg.get('path') or env_cfg.get('name')}, missing" for n in required
                 if n not in values]
    if problems:
        return {}
    return {k: (convert_value(f"env.{k}", v, known[k], problems) if known.get(k, Any) is not Any else v)
            for k, v in values.items()}


def _construct(factory: Callable, kwargs: dict[str, Any], seed: int, codec=None) -> Environment:
    """``codec``: the run's tokenizer (``rollout.tokenizer``); None: bytes at ``env.byte_offset``."""
    kwargs = dict(kwargs)
    params = _parameters(factory)
    byte_offset = kwargs.pop("byte_offset", 0)
    if "codec" in params:
        kwargs["codec"] = codec if codec is not None else ByteCodec(byte_offset)
    if "seed" in params:
        kwargs["seed"] = seed
    env = factory(**kwargs)
    if not isinstance(env, Environment):
        raise TypeError(f"path: expected the factory to return a glm5_core.rl.rollout.envs.base.Environment, "
                        f"got {type(env).__name__}")
    return env


def _unknown_builtin_keys(env_cfg: dict[str, Any]) -> list[str]:
    """Without a valid ``name`` or ``path``: the keys no built-in environment takes (a misspelt ``name`` among
    them)."""
    if "path" in env_cfg:
        return []
    known = {k for name in BUILTIN_ENVIRONMENTS for k in _config_keys(builtin_environment(name))}
    return [unknown_key("env.", str(k), [*known, "name", "path"]) for k in env_cfg if k not in known | {"name"}]


def needs_chat_template(env_cfg: Any) -> bool:
    """Whether the environment ``env`` names needs ``rollout.tokenizer`` (``requires_chat_template`` on its class
    or factory: the OpenAI proxy renders chat requests, the byte codec cannot)."""
    try:
        factory = environment_factory(env_cfg)
    except ValueError:
        return False
    return bool(getattr(factory, "requires_chat_template", False))


def env_problems(env_cfg: Any) -> list[str]:
    """The problems of an ``env`` section, one line each (empty: the run can build it)."""
    if not isinstance(env_cfg, dict):
        return [f"env: expected a mapping with 'name' or 'path', got {shown(env_cfg)}"]
    try:
        factory = environment_factory(env_cfg)
    except ValueError as exc:
        return _unknown_builtin_keys(env_cfg) + [str(exc)]
    problems: list[str] = []
    kwargs = _converted_kwargs(factory, env_cfg, problems)
    if problems:
        return problems
    try:
        _construct(factory, kwargs, seed=0)
    except (ValueError, TypeError) as exc:
        return [f"env.{exc}"]
    return []


def build_env(env_cfg: dict[str, Any], seed: int, codec=None) -> Environment:
    """The environment of a checked ``env`` section, seeded with the run's ``seed``, its text through ``codec``
    (None: bytes at ``env.byte_offset``)."""
    factory = environment_factory(env_cfg)
    problems: list[str] = []
    kwargs = _converted_kwargs(factory, env_cfg, problems)
    if problems:
        raise ValueError(problems[0])
    return _construct(factory, kwargs, seed, codec)
