"""Agent loops: environment <-> TITO gateway <-> replicas.

:class:`RolloutRunner` plays episodes on a thread pool. In async mode :meth:`RolloutRunner.run_forever`
keeps ``max_inflight_groups`` groups going and feeds the buffer as trajectories finish (pausing while the
buffer already holds ``max_buffered`` trajectories); in sync mode :meth:`RolloutRunner.run_groups` plays a
fixed number of groups and returns when all are done. Every trajectory id is issued once.

An :class:`~glm5_core.rl.rollout.envs.base.AgentEpisode` (``env.name: openai_agent``) plays itself: the runner
hands it ``generate_fn`` and the sampling settings and trains what it recorded (:meth:`RolloutRunner.play_agent`).

With ``seed`` set, every request carries a ``sampling_seed`` derived from it, the trajectory id and the turn
(``sampling_seeds``); :meth:`state_dict` / :meth:`load_state_dict` carry the group numbering (hence the ids
and seeds) and the failure counts over a resume.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Optional

from glm5_core.rl.rollout.envs.base import AgentEpisode, AgentRun, AgentSampling, Environment, Episode
from glm5_core.rl.rollout.gateway import GenerateFn, TITOGateway
from glm5_core.rl.rollout.rewards import reward_input
from glm5_core.rl.rollout.trajectory import Trajectory
from glm5_core.rl.rollout.turn_request import next_turn
from glm5_core.rl.serving.client import EngineRequestError, EngineUnavailable, MalformedResponse, is_fleet_failure
from glm5_core.rl.serving.sampling import check_top_p, check_training_temperature


class _FinishedAgent:
    """A finished agent run as :func:`reward_input` reads an episode."""

    def __init__(self, group_id: str, run: AgentRun):
        self.group_id, self.reward, self.num_turns, self._info = group_id, run.reward, run.num_turns, run.info

    def info(self) -> dict[str, float]:
        return dict(self._info)


class RolloutRunner:
    def __init__(self, env: Environment, generate_fn: GenerateFn, *, group_size: int, temperature: float,
                 top_p: float, max_len: int, max_workers: int = 32, forget_fn: Callable[[str], None] = None,
                 seed: Optional[int] = None, reward_fn: Optional[Callable[[dict], Optional[float]]] = None,
                 return_routed_experts: bool = False, return_indexer_topk: bool = False):
        self.env = env
        self.reward_fn = reward_fn  # reward plug-in (rewards.RewardScorer); None: the episode's own reward
        self.generate_fn = generate_fn
        self.group_size = group_size
        self.temperature = check_training_temperature(temperature, "temperature")  # its trajectories are trained on
        self.top_p = check_top_p(top_p)  # else every engine refuses every request
        self.max_len = max_len
        self.forget_fn = forget_fn or (lambda tid: None)
        self.replay_traces = {"return_routed_experts": return_routed_experts,  # asked of the engines (replay)
                              "return_indexer_topk": return_indexer_topk}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rl-episode")
        self.seed = seed  # None: requests carry no sampling_seed (the engines' shared generators draw)
        self._next_group = 0
        self._issued_before = 0  # trajectories issued before a resume
        self._lock = threading.RLock()  # snapshot() takes it around state_dict()
        self.issued_ids: list[str] = []
        self.env_failures = 0
        self.rollout_failures = 0  # trajectories whose generation failed on every replica tried (dropped)
        self._stop = threading.Event()

    def _new_group(self) -> list[Episode]:
        with self._lock:
            gid = f"g{self._next_group}"
            self._next_group += 1
            episodes = self.env.new_group(gid, self.group_size)
            return episodes

    def play(self, episode: Episode, trajectory_id: str) -> Trajectory:
        """Run one episode to the end through a TITO gateway (an agent episode: through its own, see
        :meth:`play_agent`)."""
        if isinstance(episode, AgentEpisode):
            return self.play_agent(episode, trajectory_id)
        gateway = TITOGateway(trajectory_id, self.generate_fn, **self.replay_traces)
        failed = rollout_failed = truncated = reward_dropped = malformed = False
        turn = 0
        try:
            while True:
                request = next_turn(episode, max_len=self.max_len, temperature=self.temperature, top_p=self.top_p,
                                    run_seed=self.seed, trajectory_id=trajectory_id, turn=turn)
                if request is None:
                    truncated = True  # context full: the episode ends unfinished (reward as the env scores it)
                    break
                turn += 1
                try:
                    response = gateway.generate(request.context, request.params)
                except MalformedResponse:  # an engine's impossible answer: counted and logged where it came in
                    failed = malformed = True
                    break
                except (EngineUnavailable, EngineRequestError) as exc:
                    if not is_fleet_failure(exc):
                        raise  # the request's own fault (a bug here), the same on any replica
                    rollout_failed = failed = True  # the fleet gave up on it (retries spent): drop, go on
                    break
                # cut by rollout.max_len (not by the environment's own max_new_tokens): a truncation
                truncated = request.cut_by_max_len and gateway.current.finish_reasons[-1] == "length"
                try:
                    if episode.observe(response["output_ids"]):
                        break
                except Exception:  # an environment crash is not a task failure
                    failed = True
                    break
            reward = 0.0 if failed else self._reward(episode, trajectory_id, gateway.finished_samples())
            if reward is None:  # the reward plug-in failed and its policy drops the trajectory
                reward, failed, reward_dropped = 0.0, True, True  # counted by the scorer
        finally:
            self.forget_fn(trajectory_id)
        if failed:
            with self._lock:
                if rollout_failed:
                    self.rollout_failures += 1
                elif not (reward_dropped or malformed):
                    self.env_failures += 1
        return Trajectory(trajectory_id, episode.group_id, gateway.finished_samples(), reward,
                          num_turns=episode.num_turns, info=episode.info(), env_failed=failed,
                          truncated=truncated and not failed)

    def play_agent(self, episode: AgentEpisode, trajectory_id: str) -> Trajectory:
        """Run an agent episode: it generates through ``generate_fn`` itself and returns what was recorded. A
        failed agent run the episode drops (its failure policy) is not trained and counts as an env failure."""
        sampling = AgentSampling(self.temperature, self.top_p, self.max_len, self.seed, **self.replay_traces)
        try:
            run = episode.run(trajectory_id, self.generate_fn, sampling)
        finally:
            self.forget_fn(trajectory_id)
        failed = run.drop or not run.samples  # nothing recorded: nothing to train
        if failed or run.failure is not None:  # a failure kept under on_failure: zero trains with reward 0
            reward = 0.0
        else:
            reward = self._reward(_FinishedAgent(episode.group_id, run), trajectory_id, run.samples)
        reward_dropped = reward is None
        if failed or reward_dropped:
            reward = 0.0
            with self._lock:
                self.env_failures += not reward_dropped  # a dropped reward is counted by the scorer
        return Trajectory(trajectory_id, episode.group_id, run.samples, reward, num_turns=run.num_turns,
                          info=dict(run.info), env_failed=failed or reward_dropped)

    def _reward(self, episode, trajectory_id: str, samples) -> Optional[float]:
        """The episode's own reward, or the reward plug-in's (None: it failed and drops the trajectory)."""
        if self.reward_fn is None:
            return float(episode.reward)
        codec = getattr(self.env, "codec", None)
        decode = getattr(codec, "decode", None)
        return self.reward_fn(reward_input(trajectory_id, episode, samples, decode))

    def next_group_id(self) -> str:
        """The id the next group will get."""
        with self._lock:
            return f"g{self._next_group}"

    def _submit_group(self) -> list[concurrent.futures.Future]:
        futures = []
        for i, episode in enumerate(self._new_group()):
            tid = f"{episode.group_id}-{i}"
            with self._lock:
                self.issued_ids.append(tid)
            futures.append(self._pool.submit(self.play, episode, tid))
        return futures

    def run_groups(self, num_groups: int) -> list[Trajectory]:
        """Sync mode: play ``num_groups`` groups concurrently, return when every trajectory is done."""
        futures = [f for _ in range(num_groups) for f in self._submit_group()]
        return [f.result() for f in futures]

    def run_forever(self, sink: Callable[[Trajectory], None], *, max_inflight_groups: int,
                    backlog: Callable[[], int], max_buffered: int, errors: list[BaseException],
                    drain_timeout: float = 300.0, admit: Optional[Callable[[str], bool]] = None) -> None:
        """Async mode: keep groups in flight until :meth:`stop`; finished trajectories go to ``sink``.
        After the stop, trajectories in flight are finished and sunk too, so none is abandoned. ``admit(group
        id)`` (staleness-paced admission): False holds the next group back until a later check."""
        inflight: dict[concurrent.futures.Future, None] = {}
        while not self._stop.is_set():
            while len(inflight) < max_inflight_groups * self.group_size and backlog() < max_buffered:
                if admit is not None and not admit(self.next_group_id()):
                    break
                for f in self._submit_group():
                    inflight[f] = None
            if not inflight:
                time.sleep(0.01)
                continue
            done, _ = concurrent.futures.wait(list(inflight), timeout=0.1,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                del inflight[f]
                try:
                    sink(f.result())
                except BaseException as exc:  # surface to the driver instead of dying silently
                    errors.append(exc)
                    self._stop.set()
        # drain: trajectories already started are finished and handed over (the buffer keeps them untrained)
        try:
            for f in concurrent.futures.as_completed(list(inflight), timeout=drain_timeout):
                try:
                    sink(f.result())
                except BaseException as exc:
                    errors.append(exc)
        except concurrent.futures.TimeoutError:
            unfinished = sum(not f.done() for f in inflight)
            errors.append(TimeoutError(f"{unfinished} trajectories still running {drain_timeout} s after the stop"))

    def issued_total(self) -> int:
        """Trajectories issued by this run, before a resume included."""
        with self._lock:
            return self._issued_before + len(self.issued_ids)

    def state_dict(self) -> dict[str, int]:
        with self._lock:
            return {"next_group": self._next_group, "issued": self._issued_before + len(self.issued_ids),
                    "env_failures": self.env_failures, "rollout_failures": self.rollout_failures}

    def snapshot(self) -> tuple[dict[str, int], dict]:
        """:meth:`state_dict` and the environment's ``state_dict()``, taken between two groups' draws."""
        with self._lock:
            return self.state_dict(), self.env.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from :meth:`state_dict` (counts checked >= 0 by the caller)."""
        with self._lock:
            self._next_group = state.get("next_group", 0)
            self._issued_before = state.get("issued", 0)
            self.env_failures = state.get("env_failures", 0)
            self.rollout_failures = state.get("rollout_failures", 0)

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_runner(cfg, env: Environment, generate_fn: GenerateFn, *, forget_fn: Callable[[str], None],
                 reward_fn: Optional[Callable[[dict], Optional[float]]], sampling_seeds: bool) -> RolloutRunner:
    """The runner of RLConfig ``cfg`` (``rollout`` sampling and threads, the replay traces ``train`` asks for);
    ``sampling_seeds``: whether its requests carry per-trajectory seeds from the run's ``seed``."""
    r = cfg.rollout
    return RolloutRunner(env, generate_fn, group_size=r.group_size, temperature=r.temperature, top_p=r.top_p,
                         max_len=r.max_len, max_workers=r.episode_threads, forget_fn=forget_fn,
                         seed=cfg.seed if sampling_seeds else None, reward_fn=reward_fn,
                         return_routed_experts=cfg.train.routing_replay,
                         return_indexer_topk=cfg.train.index_replay)
