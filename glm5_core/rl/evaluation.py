"""Held-out evaluation: greedy accuracy and pass@k on the environment's eval set.

An environment declares its eval set with ``Environment.eval_set()`` (None: it has none, and the run
evaluates nothing): one episode factory per problem, problems the environment never trains on. Each problem
is played once greedily (temperature 0) and ``eval.samples_per_problem`` = n times at the rollout
temperature; an answer is correct when its reward >= ``eval.correct_reward``. Scores use the environment's
own reward (its verifier), not a ``reward`` plug-in: the plug-in is what the policy is trained against.

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code"):
with c correct of n samples, pass@k = 1 - C(n - c, k) / C(n, k), averaged over problems. A sample the fleet
failed to generate is left out (n shrinks for its problem; a problem with fewer than k samples is left out
of pass@k).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Callable, Optional

from glm5_core.rl.rollout.envs.base import Episode
from glm5_core.rl.rollout.turn_request import next_turn
from glm5_core.rl.serving.client import EngineRequestError, EngineUnavailable, MalformedResponse, is_fleet_failure

GenerateFn = Callable[[str, dict], dict]
MapFn = Callable[[Callable, Iterable], Iterable]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Evaluator:
    """Plays the eval set through ``generate`` (the fleet) and returns the metrics of one evaluation."""

    def __init__(self, problems: list[Callable[[str], Episode]], *, generate: GenerateFn, forget: Callable[[str], None],
                 map_fn: MapFn, temperature: float, top_p: float, max_len: int, samples_per_problem: int,
                 pass_k: Iterable[int], greedy: bool, correct_reward: float, seed: Optional[int] = None):
        self.problems = list(problems)
        self.generate, self.forget, self.map_fn = generate, forget, map_fn
        self.temperature, self.top_p, self.max_len = temperature, top_p, max_len
        self.n, self.pass_k, self.greedy = samples_per_problem, sorted(set(pass_k)), greedy
        self.correct_reward = correct_reward
        self.seed = seed  # requests carry a sampling_seed from it and the trajectory id (None: no seed)
        self.count = 0

    def _play(self, episode: Episode, tid: str, temperature: float) -> Optional[float]:
        """The episode to its end (every turn); its reward, or None if the fleet gave up on it."""
        turn = 0
        try:
            while True:
                request = next_turn(episode, max_len=self.max_len, temperature=temperature, top_p=self.top_p,
                                    run_seed=self.seed, trajectory_id=tid, turn=turn)
                if request is None:
                    break
                turn += 1
                try:
                    response = self.generate(tid, {"input_ids": request.context, "return_logprob": False, "rid": tid,
                                                   "sampling_params": request.params})
                except MalformedResponse:  # counted and logged by the replica set
                    return None
                except (EngineUnavailable, EngineRequestError) as exc:
                    if not is_fleet_failure(exc):
                        raise
                    return None
                if episode.observe(response["output_ids"]):
                    break
        finally:  # unpin it and free its prefix-cache entry, like any finished trajectory
            self.forget(tid)
        return float(episode.reward)

    def _jobs(self, tag: str) -> list[tuple[int, bool, Episode, str]]:
        jobs = []
        for p, make in enumerate(self.problems):
            kinds = ([True] if self.greedy else []) + [False] * self.n
            for j, greedy in enumerate(kinds):
                tid = f"eval-{tag}-{self.count}-{p}-{j}"
                jobs.append((p, greedy, make(f"eval-{p}"), tid))
        return jobs

    def run(self, tag: str) -> dict[str, float]:
        """One evaluation: ``eval_reward`` (mean sampled reward), ``eval_greedy`` (greedy accuracy),
        ``eval_pass@k`` for each k, ``eval_problems`` and ``eval_failed`` (samples the fleet gave up on)."""
        self.count += 1

        def one(job):
            p, greedy, episode, tid = job
            return p, greedy, self._play(episode, tid, 0.0 if greedy else self.temperature)

        sampled: dict[int, list[float]] = {p: [] for p in range(len(self.problems))}
        greedy: dict[int, float] = {}
        failed = 0
        for p, is_greedy, reward in self.map_fn(one, self._jobs(tag)):
            if reward is None:
                failed += 1
            elif is_greedy:
                greedy[p] = reward
            else:
                sampled[p].append(reward)
        rewards = [r for rs in sampled.values() for r in rs]
        out: dict[str, float] = {"eval_problems": float(len(self.problems)), "eval_failed": float(failed)}
        if rewards:
            out["eval_reward"] = sum(rewards) / len(rewards)
        if greedy:
            out["eval_greedy"] = sum(r >= self.correct_reward for r in greedy.values()) / len(greedy)
        for k in self.pass_k:
            scores = [pass_at_k(len(rs), sum(r >= self.correct_reward for r in rs), k)
                      for rs in sampled.values() if len(rs) >= k]
            if scores:
                out[f"eval_pass@{k}"] = sum(scores) / len(scores)
        return out


def build_evaluator(cfg, env, *, generate: GenerateFn, forget: Callable[[str], None], runner) -> Optional[Evaluator]:
    """The evaluator of RLConfig ``cfg`` (``eval``, sampling as ``rollout``) on ``env``'s eval set, on the
    threads and seed of ``runner`` (a RolloutRunner); None when the environment has no eval set."""
    problems = env.eval_set()
    if not problems:
        return None
    r, e = cfg.rollout, cfg.eval
    return Evaluator(problems, generate=generate, forget=forget, map_fn=runner._pool.map, temperature=r.temperature,
                     top_p=r.top_p, max_len=r.max_len, samples_per_problem=e.samples_per_problem, pass_k=e.pass_k,
                     greedy=e.greedy, correct_reward=e.correct_reward, seed=runner.seed)
