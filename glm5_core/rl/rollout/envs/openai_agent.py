"""``env: {name: openai_agent, agent: "pkg.module:function", tasks: "pkg.module:function", ...}``: train an
unmodified agent written against the ``openai`` package.

The environment starts the OpenAI proxy (:mod:`glm5_core.rl.rollout.proxy`) on 127.0.0.1, on a free port, when the
run plays its first episode, and stops it when the run ends. Every episode:

1. opens a trajectory in the proxy (its id is the run's trajectory id);
2. calls ``agent(client, model, task)`` on a thread of its own, where ``client`` is an ``openai.OpenAI`` pointed at
   the proxy whose every request carries the ``X-Trajectory-Id`` header, ``model`` the name to pass as ``model=``,
   and ``task`` what ``tasks(rng)`` drew for the group (``rng``: the environment's ``random.Random``, seeded by the
   run; the ``group_size`` episodes of a group get the same task). The agent returns its reward, a finite number;
   with a ``reward:`` plug-in that number is the plug-in's ``env_reward`` and the plug-in's score replaces it;
3. closes the trajectory and hands the proxy gateway's record to the trainer: per sample, the prompt ids (mask 0)
   and the ids the engine sampled with their log-probs and weight versions (mask 1), exactly as the engine returned
   them (the proxy's chat transcript appends the template's text between turns and never re-tokenises them).

The proxy samples at the run's ``rollout.temperature`` / ``top_p`` (an agent asking for other values gets HTTP 400),
its context is ``rollout.max_len`` tokens, and requests without ``max_tokens`` get ``max_tokens`` (this section's)
new tokens. With the run's sampling seeds on, generation ``n`` of a trajectory carries the seed the built-in
environments' turn ``n`` would.

Failures, each counted by kind in the summary's ``agent_failures`` and logged (one line, ``glm5_core.rl.agents``):

* ``exception``: the agent raised (an HTTP error from the proxy included);
* ``timeout``: it ran past ``timeout_s``; the trajectory is closed, so its next request fails and its thread (a
  daemon thread: Python cannot stop it) ends; it never holds up the run;
* ``no_requests``: it returned without a single generation (there is nothing to train on);
* ``bad_reward``: it returned something that is not a finite number.

``on_failure`` says what a failed episode does: ``drop`` (the default) leaves its group untrained (as an
environment crash); ``zero`` trains what it recorded with reward 0 (an episode that recorded nothing is dropped);
``fail`` stops the run (:class:`AgentError`, one line). ``no_requests`` with ``zero`` is a drop too.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import random
import threading
from typing import Any, Callable, Optional

from glm5_core.config_schema import shown
from glm5_core.rl.plugins import load_object
from glm5_core.rl.rollout.envs.base import AgentEpisode, AgentRun, AgentSampling, Environment
from glm5_core.rl.rollout.envs.rng_state import load_rng_state, rng_state_dict
from glm5_core.rl.rollout.sampling_seeds import sampling_seed

FAILURE_POLICIES = ("drop", "zero", "fail")
FAILURE_KINDS = ("exception", "timeout", "no_requests", "bad_reward")
LOG = logging.getLogger("glm5_core.rl.agents")
GenerateFn = Callable[[str, dict], dict]


class AgentError(RuntimeError):
    """An agent episode failed under ``env.on_failure: fail``: the run stops."""


def _callable(path: Any, key: str) -> Callable:
    obj = load_object(path, key)
    if not callable(obj):
        raise ValueError(f"{key}: {path!r} names a {type(obj).__name__}, expected a function")
    return obj


class _AgentThread(threading.Thread):
    """Runs ``agent(client, model, task)`` and keeps its return value or exception."""

    def __init__(self, agent: Callable, args: tuple, name: str):
        super().__init__(name=name, daemon=True)
        self.agent, self.args = agent, args
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.result = self.agent(*self.args)
        except BaseException as exc:  # the agent's own failure, reported by the episode
            self.error = exc


class OpenAIAgentEnv(Environment):
    requires_chat_template = True  # the proxy renders chat requests: rollout.tokenizer must be set

    def __init__(self, *, agent: str, tasks: str, timeout_s: float = 300.0, on_failure: str = "drop",
                 max_tokens: int = 64, model_name: str = "glm5-core", codec=None, seed: int = 0):
        self.agent = _callable(agent, "agent")
        self.tasks = _callable(tasks, "tasks")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
            raise ValueError(f"timeout_s: expected seconds in (0, 86400], got {shown(timeout_s)}")
        if on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_failure: expected one of {', '.join(map(repr, FAILURE_POLICIES))}, "
                             f"got {shown(on_failure)}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {shown(max_tokens)}")
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name: expected a non-empty str, got {shown(model_name)}")
        if importlib.util.find_spec("openai") is None:
            raise ValueError("agent: the agent's client needs the openai package (pip install 'glm5-core[agents]')")
        try:
            self.tasks(random.Random(0))  # a broken task function is a config error, not a crash at the first group
        except Exception as exc:
            raise ValueError(f"tasks: {tasks}(rng) raised {type(exc).__name__}: {exc}") from None
        self.timeout_s, self.on_failure, self.max_tokens = float(timeout_s), on_failure, max_tokens
        self.model_name = model_name
        self.codec = codec
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._proxy = None
        self._generate_fn: Optional[GenerateFn] = None
        self._sampling: Optional[AgentSampling] = None
        self._turns: dict[str, int] = {}  # open trajectory -> generations so far (for sampling seeds)
        self.failures = {kind: 0 for kind in FAILURE_KINDS}
        self.last_error = ""

    # -- the environment -------------------------------------------------------------------------------------
    def new_group(self, group_id: str, group_size: int) -> list[OpenAIAgentEpisode]:
        task = self.tasks(self._rng)
        return [OpenAIAgentEpisode(self, group_id, task) for _ in range(group_size)]

    def state_dict(self) -> dict:
        return rng_state_dict(self._rng)

    def load_state_dict(self, state: dict) -> None:
        load_rng_state(self._rng, state)

    def close(self) -> None:
        with self._lock:
            proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.shutdown()

    def failure_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.failures)

    # -- the proxy -------------------------------------------------------------------------------------------
    def proxy(self, generate_fn: GenerateFn, sampling: AgentSampling):
        """The running proxy (started on the first call), generating through ``generate_fn``."""
        from glm5_core.rl.rollout.proxy import OpenAIProxy

        with self._lock:
            if self._proxy is None:
                if not hasattr(self.codec, "has_chat_template") or not self.codec.has_chat_template:
                    raise ValueError("env.name: 'openai_agent' needs rollout.tokenizer (a tokenizer directory with a "
                                     "chat template); the byte codec has none")
                self._generate_fn, self._sampling = generate_fn, sampling
                self._proxy = OpenAIProxy(self.codec, self._generate, max_context_tokens=sampling.max_len,
                                          model_name=self.model_name, default_max_tokens=self.max_tokens,
                                          max_new_tokens=min(1024, sampling.max_len - 1),
                                          temperature=sampling.temperature, top_p=sampling.top_p,
                                          return_routed_experts=sampling.return_routed_experts,
                                          return_indexer_topk=sampling.return_indexer_topk).start()
            assert generate_fn == self._generate_fn and sampling == self._sampling, "one run, one proxy"
            return self._proxy

    def _generate(self, trajectory_id: str, request: dict) -> dict:
        """The proxy's generations, with the run's per-turn sampling seed when it sends them."""
        with self._lock:
            turn = self._turns.get(trajectory_id, 0)
            self._turns[trajectory_id] = turn + 1
        if self._sampling.seed is not None:
            request = {**request, "sampling_params": {**request["sampling_params"],
                                                      "sampling_seed": sampling_seed(self._sampling.seed,
                                                                                     trajectory_id, turn)}}
        return self._generate_fn(trajectory_id, request)

    def forget_turns(self, trajectory_id: str) -> None:
        with self._lock:
            self._turns.pop(trajectory_id, None)

    def record_failure(self, kind: str, trajectory_id: str, detail: str) -> bool:
        """Count and log a failed episode; True when its policy drops it. Raises :class:`AgentError` under
        ``fail``."""
        message = f"agent failed ({kind}) on trajectory {trajectory_id!r}: {detail}"
        if self.on_failure == "fail":
            raise AgentError(message + " (env.on_failure: fail)")
        with self._lock:
            self.failures[kind] += 1
            self.last_error = message
        LOG.warning("%s (env.on_failure: %s)", message, self.on_failure)
        return self.on_failure == "drop" or kind == "no_requests"


class OpenAIAgentEpisode(AgentEpisode):
    def __init__(self, env: OpenAIAgentEnv, group_id: str, task: Any):
        self.env, self.group_id, self.task = env, group_id, task

    def _client(self, proxy, trajectory_id: str):
        import openai

        from glm5_core.rl.rollout.proxy import TRAJECTORY_HEADER

        return openai.OpenAI(base_url=proxy.base_url, api_key="glm5-core-proxy", max_retries=0,
                             timeout=self.env.timeout_s, default_headers={TRAJECTORY_HEADER: trajectory_id})

    def run(self, trajectory_id: str, generate_fn: GenerateFn, sampling: AgentSampling) -> AgentRun:
        env = self.env
        proxy = env.proxy(generate_fn, sampling)
        proxy.open_trajectory(trajectory_id)
        client = self._client(proxy, trajectory_id)
        thread = _AgentThread(env.agent, (client, env.model_name, self.task), f"agent-{trajectory_id}")
        try:
            thread.start()
            thread.join(env.timeout_s)
        finally:
            record = proxy.close_trajectory(trajectory_id)  # a late request of a timed-out agent now fails
            env.forget_turns(trajectory_id)
        if not thread.is_alive():
            client.close()  # a running agent still holds it; its thread ends on the closed trajectory
        samples = record.gateway.finished_samples()
        info = {"agent_requests": float(record.gateway.num_requests), "rerenders": float(record.transcript.rerenders)}
        failure, detail, reward = self._outcome(thread, samples)
        drop = failure is not None and env.record_failure(failure, trajectory_id, detail)
        return AgentRun(samples, reward, num_turns=record.gateway.num_requests, info=info, failure=failure, drop=drop)

    def _outcome(self, thread: _AgentThread, samples) -> tuple:
        """(failure kind or None, its detail, the reward)."""
        if thread.is_alive():
            return "timeout", f"still running after timeout_s={self.env.timeout_s}", 0.0
        if thread.error is not None:
            return "exception", f"{type(thread.error).__name__}: {thread.error}"[:500], 0.0
        if not samples:
            return "no_requests", "the agent returned without a generation", 0.0
        value = thread.result
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return "bad_reward", f"expected the agent to return a finite number, got {shown(value)}", 0.0
        return None, "", float(value)
