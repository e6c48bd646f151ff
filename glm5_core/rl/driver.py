"""The RL run: composes the components of an :class:`RLConfig` and runs the sync or async loop. Each component
is built from its config section by the ``build_*`` function beside it (policy, environment, trainer, run state,
router, executor, replicas, weight sync, buffer, runner, evaluator, metrics), in that order.

sync:  rollout a full batch (all groups at once) -> train one step -> push weights -> repeat. The trainer
       waits for the slowest trajectory, the engines wait for the trainer.
async: a producer thread keeps groups in flight and fills the buffer; the trainer takes a batch whenever
       ``batch_size`` trajectories are ready, drops those older than ``max_staleness`` versions, and pushes
       weights every ``push_every`` steps while generation goes on.

Engines are spawned (local processes or Ray actors, on ``rollout.devices``) or external
(``rollout.engine_urls``: SGLang servers, ``glm5 serve``); weights reach them as ``rollout.weight_sync`` says
(see ``fleet/weight_sync``). A trainer that receives no batch for ``train.max_idle_minutes`` ends the run
with :class:`TrainerStarvedError` naming what went wrong.

Resume points (``checkpoint.every_steps``, and at the end) and ``resume=True``: ``run_state``. Requests to
spawned engines (to every engine with ``rollout.sampling_seeds: true``) carry per-trajectory sampling seeds
(``rollout/sampling_seeds``).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import threading
import time
from typing import Callable, Optional

from glm5_core.rl import run_state
from glm5_core.rl.algorithm.buffer import build_buffer, staleness
from glm5_core.rl.algorithm.offpolicy_mask import mask_offpolicy
from glm5_core.rl.algorithm.trainer import build_trainer
from glm5_core.rl.algorithm.truncation import for_training, penalized
from glm5_core.rl.config import RLConfig
from glm5_core.rl.evaluation import build_evaluator
from glm5_core.rl.fleet.executors import build_executor
from glm5_core.rl.fleet.placement import (
    allowed_cores,
    check_visible,
    engine_devices,
    pin_trainer,
    probe_accelerators,
)
from glm5_core.rl.fleet.replicas import ReplicaSet, TrajectoryCloser
from glm5_core.rl.fleet.router import build_router
from glm5_core.rl.fleet.weight_sync import build_weight_sync
from glm5_core.rl.metrics import MetricsLogger, idle_ratio_from_engines, prefill_counters
from glm5_core.rl.policy import build_policy, build_starting_policy, parallelize_policy
from glm5_core.rl.rollout.envs.registry import build_env
from glm5_core.rl.rollout.response_check import ResponseCheck
from glm5_core.rl.rollout.rewards import build_reward
from glm5_core.rl.rollout.run_codec import TOKENIZER_KEY, load_run_tokenizer, vocab_problem
from glm5_core.rl.rollout.runner import build_runner
from glm5_core.rl.rollout.trajectory import Trajectory
from glm5_core.rl.run_state import RunState
from glm5_core.rl.serving.client import EngineClient
from glm5_core.rl.serving.worker import WorkerSpec, set_process_affinity

StepHook = Callable[[int, "RLRun"], None]
PRODUCER_DRAIN_S = 300.0  # after the last step, how long trajectories in flight may take to finish


class TrainerStarvedError(RuntimeError):
    """No training batch arrived for ``train.max_idle_minutes``: the run cannot make progress."""


class FleetUnreachableError(RuntimeError):
    """An external engine (``rollout.engine_urls``) did not answer ``/health`` within the run's budget."""


FLEET_POLL_S = 0.5


def build_environment(cfg: RLConfig, vocab_size: int):
    """``rollout.tokenizer`` (None: the byte codec) and the environment ``env`` names (rl/rollout/envs/registry),
    seeded with the run's seed; raises ValueError when the environment's codec does not fit ``vocab_size``."""
    tokenizer = load_run_tokenizer(cfg.rollout.tokenizer) if cfg.rollout.tokenizer is not None else None
    env = build_env(cfg.env, cfg.seed, codec=tokenizer)
    codec = getattr(env, "codec", None)  # a plug-in environment may bring its own tokens
    key = TOKENIZER_KEY if tokenizer is not None else "env.byte_offset"
    problem = codec is not None and vocab_problem(codec, vocab_size, key)
    if problem:
        raise ValueError(problem)
    return tokenizer, env


@dataclasses.dataclass
class _Progress:
    """What the training loop counts between steps."""

    started: float
    deadline: float
    last_batch: float
    waited: float = 0.0
    trained_tokens: float = 0.0
    context_tokens: float = 0.0


class RLRun:
    def __init__(self, cfg: RLConfig, *, checkpoint: Optional[str] = None, backend: Optional[str] = None,
                 output_dir: Optional[str] = None, hooks: list[StepHook] = (), log: Callable[[str], None] = print,
                 probe: Callable[[], dict[str, int]] = probe_accelerators, resume: bool = False):
        """``resume``: continue the run in the output dir (see ``run_state``); without it the output dir must be
        new or empty."""
        self.cfg = cfg
        self.out_dir = output_dir or cfg.output_dir
        run_state.check_output_dir(self.out_dir, resume)
        if resume:
            started_from = run_state.check_same_run(self.out_dir, cfg, checkpoint)
            checkpoint = started_from if checkpoint is None else checkpoint
        self.backend = None if backend in (None, "auto") else backend
        self.hooks = list(hooks)
        self.log = log
        r = cfg.rollout
        self.external = r.engine_urls is not None
        self.engine_devices = engine_devices(r.devices, r.num_engines)
        check_visible([d for d in self.engine_devices if d], "rollout.devices", probe)
        if cfg.train.device:
            check_visible([cfg.train.device], "train.device", probe)
        self._affinity_before = allowed_cores()  # restored when the run ends (a caller may start another run)
        self.trainer_cores = pin_trainer(cfg.train.device, cfg.torch_threads)  # a core set: pinned, 1 thread/core
        self.model = build_starting_policy(cfg, checkpoint, self.backend, self.out_dir, resume, log)
        if r.speculative is not None and not self.external:  # e.g. a checkpoint whose shards hold no MTP layer
            from glm5_core.rl.serving.speculative import check_draft_model

            check_draft_model(self.model, "rollout.speculative")
        self.tokenizer, self.env = build_environment(cfg, self.model.config.vocab_size)
        self.reward = build_reward(cfg.reward)  # None: the environment's own reward
        self.parallel = parallelize_policy(cfg, self.model)  # parallel.ep: the policy trainer's layout
        self.trainer = build_trainer(cfg, self.model, self.backend, parallel=self.parallel)
        resumed = run_state.start(self.out_dir, cfg, checkpoint, self.trainer, self.model, resume, log)
        self.resumed_state: Optional[RunState] = resumed[0] if resumed else None
        self._checkpoint_history: list[str] = resumed[1] if resumed else []
        self._checkpointed_version = self.trainer.version if resumed else None
        self._resumed_at = self.trainer.version if resume else None
        self.eval_history: list[dict] = list(self.resumed_state.eval_history) if resumed else []
        self.weights_dir = os.path.join(self.out_dir, "weights")
        self.latest_weights = self.trainer.save_weights(self.weights_dir)
        self.latest_version = self.trainer.version
        self.pushed_version = self.latest_version  # the engines boot from (or are first pushed) these weights
        self.masked_offpolicy_tokens = 0
        self.router = build_router(r)
        self.executor = build_executor(cfg, self._spec)
        names = self.executor.names if self.external else [f"engine{i}" for i in range(r.num_engines)]
        check = ResponseCheck(vocab_size=self.model.config.vocab_size, newest_version=lambda: self.latest_version)
        self.replicas = ReplicaSet(self.executor, self.router, names, client_factory=self._client,
                                   check_response=check)
        self.weight_sync = build_weight_sync(r, self.replicas)
        self.replicas.catch_up = self.weight_sync.catch_up  # a readmitted engine gets the newest weights first
        self.buffer = build_buffer(cfg)
        self.closer = TrajectoryCloser(self.replicas.end_trajectories)
        self.runner = build_runner(cfg, self.env, self.replicas.generate, forget_fn=self._trajectory_done,
                                   reward_fn=self.reward, sampling_seeds=self._sends_sampling_seeds())
        self.evaluator = build_evaluator(cfg, self.env, forget=self._trajectory_done, runner=self.runner,
                                         generate=lambda tid, request: self.replicas.generate(tid, request))
        self.truncated_trajectories = 0
        if self.resumed_state is not None:
            self._restore(self.resumed_state)
        self.metrics = MetricsLogger(self.out_dir, resume_step=(self.trainer.version if resumed else -1)
                                     if resume else None)
        self.summary: dict = {}
        self._producer: Optional[threading.Thread] = None
        self._producer_errors: list[BaseException] = []

    # -- construction -------------------------------------------------------------------------------------
    def _restore(self, state: RunState) -> None:
        """The environment, runner and buffer of a resume point (the trainer's part is loaded already)."""
        where = f"checkpoint: {self.out_dir}/checkpoints (step {self.trainer.version}) data."
        try:
            self.env.load_state_dict(state.env)
            self.runner.load_state_dict(state.runner)
            self.buffer.load_state_dict(state.buffer)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None
        self.log(f"[rl] resumed at step {self.trainer.version} from {self.out_dir}")

    def _sends_sampling_seeds(self) -> bool:
        """Whether requests carry ``sampling_seed``: ``rollout.sampling_seeds``, or by default spawned engines only."""
        chosen = self.cfg.rollout.sampling_seeds
        return (not self.external) if chosen is None else chosen

    def _client(self, url: str) -> EngineClient:
        return EngineClient(url, api_key=self.cfg.rollout.api_key, allow_remote=self.external)

    def _trajectory_done(self, trajectory_id: str) -> None:
        """A trajectory ended: unpin it from its replica and (batched) free its engines' prefix-cache entries."""
        self.router.forget(trajectory_id)
        self.closer.add(trajectory_id)

    def _spec(self, name: str) -> WorkerSpec:
        r = self.cfg.rollout
        index = int(name.replace("engine", "") or 0)
        return WorkerSpec(model_config=self.model.config.to_hf_dict(), weights_path=self.latest_weights,
                          weight_version=self.latest_version, weights_dir=self.weights_dir, backend=self.backend,
                          max_batch=r.max_batch, max_len=r.max_len, prefix_cache_entries=r.prefix_cache_entries,
                          prefix_cache_tokens=r.prefix_cache_tokens, speculative=r.speculative,
                          seed=self.cfg.seed * 1000 + index + 7919 * self.latest_version,
                          torch_threads=r.engine_threads, placement=self.engine_devices[index],
                          record_routing=self.cfg.train.routing_replay, record_index_topk=self.cfg.train.index_replay)

    # -- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self) -> Optional[dict[str, float]]:
        """Greedy accuracy, pass@k and mean sampled reward on the environment's held-out eval set (see
        ``rl/evaluation``), recorded in ``eval_history``; None if the environment has no eval set."""
        if self.evaluator is None:
            return None
        result = self.evaluator.run(str(self.trainer.version))
        self.closer.flush()  # free the evaluation's cache entries now, not with the next training batch
        self.eval_history.append({"step": self.trainer.version, **result})
        return result

    # -- weights --------------------------------------------------------------------------------------------
    def _push_weights(self) -> None:
        """The trainer's weights to every engine (``rollout.weight_sync``)."""
        self.latest_weights = self.trainer.save_weights(self.weights_dir)  # what a restarted worker boots from
        self.latest_version = self.trainer.version
        self._push_latest()
        self.pushed_version = self.latest_version  # every engine holds it (or is caught up before it serves)

    def _push_latest(self) -> None:
        if self.cfg.rollout.weight_sync == "distributed":
            self.weight_sync.push(self.model, self.latest_version, saved=self.latest_weights)
        elif self.external:  # SGLang loads an HF-format directory
            from glm5_core.rl.fleet.weight_sync import write_hf_directory

            path = write_hf_directory(self.model, os.path.join(self.weights_dir, "hf"))
            self.weight_sync.push(os.path.abspath(path), self.latest_version)
        else:
            self.weight_sync.push(self.latest_weights, self.latest_version)

    # -- the run, step by step ----------------------------------------------------------------------------
    def run(self) -> dict:
        budget_end = time.monotonic() + self.cfg.max_minutes * 60  # waiting for the fleet counts too
        try:
            self._start_fleet(budget_end)
            eval0 = self._evaluate_at_start()
            info_start = self.replicas.info()
            progress = self._start_loop(budget_end)
            while self.trainer.version < self.cfg.max_steps and time.monotonic() < progress.deadline:
                batch = self._next_batch(progress)
                if batch is None:
                    if self.cfg.mode == "async":
                        break  # the budget ran out while waiting
                    continue
                row = self._train_on(batch, progress)
                self._log_step(row)
                if self.cfg.checkpoint.every_steps and self.trainer.version % self.cfg.checkpoint.every_steps == 0:
                    self.save_resume_point()
            if self._checkpointed_version != self.trainer.version:
                self.save_resume_point()
            elapsed = time.monotonic() - progress.started
            self._drain()
            return self._finish(eval0, info_start, progress, elapsed)
        except BaseException as exc:  # interrupted (Ctrl-C) or failed: plot what was trained
            self._plot_partial(exc)
            raise
        finally:
            self._teardown()

    def _curve_title(self) -> str:
        return f"glm5 rl ({self.cfg.env.get('name') or self.cfg.env.get('path')}, {self.cfg.mode})"

    def _plot_partial(self, exc: BaseException) -> None:
        """The reward curve of the steps trained before ``exc``, titled as partial; after Ctrl-C one log line
        says where (an error keeps the CLI's own one line)."""
        if not any("reward" in row for row in self.metrics.rows):
            return
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by {type(exc).__name__}"
        done = self.trainer.version
        try:
            path = self.metrics.reward_curve(
                title=f"{self._curve_title()}: partial run, {why} at step {done} of {self.cfg.max_steps}")
        except Exception:  # the plot must never hide the interruption
            path = None
        if isinstance(exc, KeyboardInterrupt):
            shown = (f"{path} plots the steps trained" if path else
                     "metrics.jsonl holds the steps trained (reward curve skipped: matplotlib not installed)")
            self.log(f"[rl] {why} at step {done} of {self.cfg.max_steps}: {shown}")

    def _start_fleet(self, budget_end: float) -> None:
        """Start (or reach) the engines; external ones must answer ``/health`` before ``budget_end``
        (:class:`FleetUnreachableError` naming the first that did not), then get the trainer's initial weights,
        so every engine samples from the policy the trainer starts from."""
        self.replicas.start()
        if self.external:
            for name in self.replicas.names:
                client = self.replicas.clients[name]
                while not client.health(timeout=FLEET_POLL_S):
                    if time.monotonic() + FLEET_POLL_S > budget_end:
                        raise FleetUnreachableError(
                            f"rollout.engine_urls: {client.url} ({name}) did not answer /health within the run's "
                            f"budget (max_minutes {self.cfg.max_minutes:g})")
                    time.sleep(FLEET_POLL_S)
            self._push_weights()

    def _evaluate_at_start(self) -> Optional[dict[str, float]]:
        if self.resumed_state is not None:  # evaluated when the run started: its step-0 entry
            return next(({k: v for k, v in e.items() if k != "step"} for e in self.eval_history if e["step"] == 0),
                        None)
        eval0 = self.evaluate()
        if eval0 is not None:
            self.log(f"[rl] eval at step 0: {_eval_text(eval0)}")
            self.metrics.log(0, eval0)
        return eval0

    def save_resume_point(self) -> None:
        """``checkpoints/step_<version>``: what ``resume=True`` continues from (``run_state``). Under torchrun
        (a policy sharded over several ranks) none is written, said once (``policy.torchrun_problem``)."""
        if self.parallel is not None and self.parallel.world_size > 1:
            if self._checkpointed_version is None:
                self.log("[rl] no resume point written: glm5 rl under torchrun has no sharded resume-point format yet")
            self._checkpointed_version = self.trainer.version
            return
        eval_start = next((e.get("eval_reward") for e in self.eval_history if e.get("step") == 0), None)
        runner, env = self.runner.snapshot()  # together: an async producer may be drawing the next group
        state = RunState(env=env, runner=runner, buffer=self.buffer.state_dict(), eval_history=self.eval_history,
                         eval_start=eval_start)
        self._checkpoint_history = run_state.save_resume_point(
            self.out_dir, self.trainer, state, keep_last=self.cfg.checkpoint.keep_last,
            history=self._checkpoint_history)
        self._checkpointed_version = self.trainer.version

    def _start_loop(self, budget_end: float) -> _Progress:
        now = time.monotonic()
        progress = _Progress(started=now, deadline=budget_end, last_batch=now)
        if self.cfg.mode == "async":
            self._producer = threading.Thread(
                target=self.runner.run_forever, name="rl-producer", daemon=True,
                kwargs=dict(sink=self._accept, max_inflight_groups=self.cfg.rollout.max_inflight_groups,
                            backlog=self.buffer.num_ready, max_buffered=self.cfg.rollout.max_buffered,
                            errors=self._producer_errors, drain_timeout=PRODUCER_DRAIN_S,
                            admit=self._admit if self.buffer.admission else None))
            self._producer.start()
        return progress

    def _admit(self, group_id: str) -> bool:
        """Staleness-paced admission: the group starts under ``pushed_version`` (every engine holds it)."""
        return self.buffer.try_admit(group_id, self.pushed_version, self.trainer.version)

    def _next_batch(self, progress: _Progress):
        """The next training batch (None: none this time); raises :class:`TrainerStarvedError` once none came
        for ``train.max_idle_minutes``."""
        t0 = time.monotonic()
        starve_at = progress.last_batch + self.cfg.train.max_idle_minutes * 60
        if self.cfg.mode == "async":
            batch = self.buffer.take(self.trainer.version, timeout=max(0.1, min(progress.deadline, starve_at) - t0))
            if self._producer_errors:
                raise self._producer_errors[0]
        else:
            batch = self._sync_batch()
        now = time.monotonic()
        progress.waited += now - t0
        if batch is not None:
            progress.last_batch = now
        elif now >= starve_at and now < progress.deadline:
            raise TrainerStarvedError(self._starvation_reason(now - progress.last_batch))
        return batch

    def _accept(self, trajectory: Trajectory) -> None:
        """A finished trajectory into the buffer (its reward as ``train.truncation`` says)."""
        if trajectory.truncated:
            self.truncated_trajectories += 1
        self.buffer.put(penalized(trajectory, self.cfg.train.truncation, self.cfg.train.truncation_reward))

    def _sync_batch(self):
        """Sync mode: roll out the groups still missing from the batch (failed groups leave it short), again
        for the groups dynamic sampling held back, for at most ``dynamic_sampling.max_rounds`` rounds."""
        ds = self.cfg.dynamic_sampling
        rounds = ds.max_rounds if ds.enabled else 1
        for round_ in range(1, rounds + 1):
            missing = max(0, self.cfg.train.batch_size - self.buffer.num_ready())
            for t in self.runner.run_groups(-(-missing // self.cfg.rollout.group_size)):
                self._accept(t)
            batch = self.buffer.take(self.trainer.version, timeout=0, fill_held=round_ == rounds)
            if batch is not None:
                return batch
        return None

    def _starvation_reason(self, idle_s: float) -> str:
        sync_error = getattr(self.weight_sync, "last_error", "")
        return (f"no training batch for {idle_s / 60:.1f} min (train.max_idle_minutes="
                f"{self.cfg.train.max_idle_minutes}) at step {self.trainer.version}: "
                f"{self.buffer.dropped_stale} trajectories dropped as stale (train.max_staleness="
                f"{self.cfg.train.max_staleness}), {self.runner.rollout_failures} rollouts failed on every engine, "
                f"{self.runner.env_failures} environment failures, {self.replicas.dropped_malformed} malformed engine "
                f"answers, healthy engines "
                f"{self.router.healthy_replicas() or 'none'}"
                + (f"; last engine error: {self.replicas.last_error}" if self.replicas.last_error else "")
                + (f"; last weight-sync error: {sync_error}" if sync_error else ""))

    def _train_on(self, batch, progress: _Progress) -> dict:
        """One optimizer step on ``batch`` (and a weight push when due); the step's metrics row."""
        ages = staleness(batch, self.trainer.version)  # versions behind the trainer
        batch, masked = mask_offpolicy(batch, self.trainer.version, self.cfg.train.mask_offpolicy)
        self.masked_offpolicy_tokens += masked
        stats = self.trainer.train_step(for_training(batch, self.cfg.train.truncation))
        if self.trainer.should_push():
            self._push_weights()
        progress.trained_tokens += stats["trained_tokens"]
        progress.context_tokens += stats["context_tokens"]
        elapsed = time.monotonic() - progress.started
        row = dict(stats)
        row.update(reward=sum(t.reward for t in batch) / len(batch),
                   turns=sum(t.num_turns for t in batch) / len(batch),
                   trainer_idle_ratio=progress.waited / elapsed, elapsed_s=elapsed,
                   trained_tokens_per_s=progress.trained_tokens / elapsed,
                   staleness_mean=statistics.mean(ages) if ages else 0.0,  # none if nothing was sampled
                   staleness_histogram={str(k): n for k, n in sorted(collections.Counter(ages).items())},
                   dropped_stale=self.buffer.dropped_stale, replacements=self.replicas.replacements,
                   dropped_malformed=self.replicas.dropped_malformed,
                   truncated=sum(t.truncated for t in batch) / len(batch))
        row.update(self._plugin_counters())
        step = self.trainer.version
        if self.cfg.eval.every and step % self.cfg.eval.every == 0:
            row.update(self.evaluate() or {})
        return row

    def _plugin_counters(self) -> dict:
        """Dynamic sampling, truncation and reward-plug-in counters, run totals so far."""
        out = {"truncated_trajectories": self.truncated_trajectories}
        if self.cfg.train.mask_offpolicy is not None:
            out["masked_offpolicy_tokens"] = self.masked_offpolicy_tokens
        if self.buffer.admission:
            out["admission_refusals"] = self.buffer.admission_refusals
        if self.buffer.dynamic is not None:
            out.update(self.buffer.dynamic.counters())
        if self.reward is not None:
            out["reward_failures"] = self.reward.failures
        agent_failures = getattr(self.env, "failure_counts", None)  # agent environments (env.on_failure)
        if agent_failures is not None:
            out["agent_failures"] = agent_failures()
        return out

    def _log_step(self, row: dict) -> None:
        step = self.trainer.version
        self.metrics.log(step, row)
        if step % 10 == 0 or step == 1:
            self.log(f"[rl] step {step} reward {row['reward']:.3f} idle {row['trainer_idle_ratio']:.2f} "
                     f"tok/s {row['trained_tokens_per_s']:.1f} masked {row['masked_tokens']:.3f}"
                     + (f" eval {_eval_text(row)}" if "eval_problems" in row else ""))
        for hook in self.hooks:
            hook(step, self)

    def _drain(self) -> None:
        """Stop issuing rollouts; the producer finishes the trajectories in flight before it returns."""
        self.runner.stop()
        if self._producer is not None:
            self._producer.join(timeout=PRODUCER_DRAIN_S + 30)
            if self._producer.is_alive():
                self._producer_errors.append(
                    TimeoutError(f"rollout producer still draining after {PRODUCER_DRAIN_S} s"))

    def _finish(self, eval0: Optional[dict[str, float]], info_start: dict, progress: _Progress, elapsed: float) -> dict:
        """Final evaluation, the summary (written to summary.json), the reward curve."""
        info_end = self.replicas.info()
        eval_end = self.evaluate()
        counters = prefill_counters(info_end)
        per_s = max(elapsed, 1e-9)
        self.summary = {
            "mode": self.cfg.mode, "steps": self.trainer.version, "elapsed_s": elapsed,
            "trained_tokens": progress.trained_tokens, "trained_tokens_per_s": progress.trained_tokens / per_s,
            "context_tokens_per_s": progress.context_tokens / per_s,
            "trainer_idle_ratio": progress.waited / per_s,
            "rollout_idle_ratio": idle_ratio_from_engines(info_start, info_end),
            "staleness_histogram": {str(k): v for k, v in sorted(self.buffer.staleness_histogram.items())},
            "dropped_stale": self.buffer.dropped_stale, "env_failures": self.runner.env_failures,
            "rollout_failures": self.runner.rollout_failures, "dropped_malformed": self.replicas.dropped_malformed,
            "continued_generations": self.replicas.continued_generations,
            "replacements": self.replicas.replacements, "failed_restarts": self.replicas.failed_restarts,
            "failed_requests": self.replicas.failed_requests,
            "prefill_tokens": counters["prefill_tokens"], "prefill_tokens_saved": counters["cached_tokens"],
            "engine_busy_s": counters["busy_seconds"], "engine_prefill_s": counters["prefill_seconds"],
            "weight_sync": self.cfg.rollout.weight_sync, "weight_sync_s": list(self.weight_sync.seconds),
            "failed_pushes": getattr(self.weight_sync, "failed_pushes", 0),
            "catch_up_pushes": self.weight_sync.catch_ups,
            "eval_reward_start": (eval0 or {}).get("eval_reward"),
            "eval_reward_end": (eval_end or {}).get("eval_reward"),
            "eval_start": eval0, "eval_end": eval_end, "eval_history": list(self.eval_history),
            **self._plugin_counters(),
            "issued_trajectories": self.runner.issued_total(), "trained_trajectories": self.buffer.trained_total(),
            "resumed_at_step": self._resumed_at,
            "producer_errors": [f"{type(e).__name__}: {e}" for e in self._producer_errors],
        }
        if eval_end is not None:
            self.log(f"[rl] eval at step {self.trainer.version}: {_eval_text(eval_end)}")
            self.metrics.log(self.trainer.version, eval_end)
        self.metrics.log(self.trainer.version, {"summary": self.summary})
        title = self._curve_title()
        if self.trainer.version < self.cfg.max_steps:  # the max_minutes budget ended the run first
            self.summary["partial"] = {"steps_done": self.trainer.version, "max_steps": self.cfg.max_steps}
            title += f": partial run, steps 1-{self.trainer.version} of {self.cfg.max_steps} (max_minutes)"
        self.summary["reward_curve"] = self.metrics.reward_curve(title=title)
        self.summary["metrics_skipped"] = list(self.metrics.skipped)
        with open(os.path.join(self.out_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(self.summary, f, indent=2)
        return self.summary

    def _teardown(self) -> None:
        self.runner.stop()
        self.runner.shutdown()
        self.env.close()
        self.buffer.close()
        self.weight_sync.shutdown()
        self.replicas.shutdown()
        self.metrics.close()
        if self.trainer_cores is not None and self._affinity_before:
            set_process_affinity(self._affinity_before)  # the calling process gets its cores back

    def accounting(self) -> dict[str, list[str]]:
        """Where every issued trajectory ended up (for exactly-once checks)."""
        return {"issued": list(self.runner.issued_ids), "trained": list(self.buffer.taken_ids),
                "dropped": list(self.buffer.dropped_ids), "buffered": self.buffer.leftover_ids()}


def follow_training(cfg: RLConfig, checkpoint: Optional[str], backend: Optional[str]) -> None:
    """A rank other than 0 of ``glm5 rl`` under torchrun: build the policy and its trainer as rank 0's
    :class:`RLRun` does (same seed, same ``parallel`` layout), then run rank 0's collective trainer calls until
    it releases this rank (``PolicyTrainer.follow``)."""
    import torch

    torch.set_num_threads(cfg.torch_threads)
    backend = None if backend in (None, "auto") else backend
    model = build_policy(cfg, checkpoint, backend)
    trainer = build_trainer(cfg, model, backend, parallel=parallelize_policy(cfg, model))
    trainer.follow()


def _eval_text(result: dict) -> str:
    """One evaluation's figures for the log line: greedy accuracy, pass@k, mean sampled reward."""
    keys = [k for k in ("eval_greedy", *sorted(k for k in result if k.startswith("eval_pass@")), "eval_reward")
            if k in result]
    return " ".join(f"{k[len('eval_'):]} {result[k]:.3f}" for k in keys) or "no answer scored"
