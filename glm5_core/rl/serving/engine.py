"""Rollout engine: continuous batching over the model's KV cache.

Legend: S slots (``max_batch``), L ``max_len``, V vocabulary.

* One batched KVCache of S slots. Requests admitted in one step are prefilled together in a scratch
  cache of one row per request (seeded with whatever prefix the trajectory's prefix cache can supply);
  their rows are then copied into free slots of the batched cache. Every scheduler step decodes one token
  for all active slots at once (ragged ``start_pos [S]``). A finished request frees its slot at once and a
  waiting one takes it on the next step (continuous batching).
* Decode steps run on ``decode_threads`` threads (default 1), each over a contiguous group of the active
  slots and, on cpu, with one torch intra-op thread: a step is many small ops, and splitting each of them
  across cores costs more than it saves (measured in ``benchmarks/bench_vs_transformers.py``); prefill keeps
  the caller's thread setting. Each group's forward covers only its slots' window of the batched cache.
  The MoE layers keep their stacked expert weights between steps (``reuse_stacked_weights``, dropped on
  every weight push).
* Attention is ``"sparse"`` (DSA with the deterministic top-k, the same path the trainer recomputes).
* Each sampled token carries its log-prob (temperature-scaled softmax, see ``sampling``) and the weight
  version that produced it. Weight updates land between steps; the prefix cache is flushed then. Each
  slot remembers the weight version its KV was computed under (the oldest one, if an update landed
  mid-generation); a finished slot whose KV predates the current weights is not stored in the prefix
  cache, so the trajectory's next turn is prefilled in full under the new weights. The prefix cache is
  budgeted in entries and optionally in cached positions (``prefix_cache_tokens``). It holds only
  trajectories that are not running here: an admitted request's entry leaves the cache (its KV now lives in
  the slot and is stored back, extended, when the request finishes), and :meth:`end_trajectory` frees a
  finished trajectory's entry.
* ``speculative={"draft_tokens": d}`` (off by default): each decode step drafts d tokens per slot with the
  model's MTP layer and verifies them in one forward; a slot emits 1..d+1 tokens per step, distributed exactly
  as plain sampling's (see ``speculative`` and ``speculative_sampling``).
* Every tensor the engine creates lives on the model's device.
* Sampling: a request with a ``sampling_seed`` draws from a generator of its own, seeded with it, one draw per
  token; the others share the engine's generator (seeded at start), so what they draw depends on which
  requests were decoded with them. Seeded draws do not; the logits can still differ in the last bit with the
  batch a request was prefilled or decoded in (measured on CPU), so bitwise repetition also needs the same
  batches (``max_batch`` 1). With ``speculative`` on, the seed's generator also draws the request's drafts,
  acceptance tests and corrected / bonus tokens (a fixed count per step, see ``SpeculativeDecoder._uniforms``).
* Replay traces (``record_routing`` / ``record_index_topk``): the cache also keeps each position's experts /
  selected keys, so they travel with the KV through the prefix cache and the slots; a finished request that
  asked (``return_routed_experts`` / ``return_indexer_topk``) gets them for its whole sequence but the last
  token (``replay_trace``).
* Weight sync as SGLang does it: :meth:`pause` stops the scheduler between steps (``in_place``: running
  requests keep their slots and KV; ``abort``: they finish with ``finish_reason`` abort), updates land (a full
  state dict, or ``partial=True`` buckets of it, applied in order before the next step and while paused),
  :meth:`resume` continues. A request that spans an update records, per token, the version it was sampled
  under. Requests submitted while paused wait in the queue.
* Thread model: :meth:`submit` may be called from any thread; :meth:`step` runs on one scheduler thread
  (:meth:`start`) or is driven by the caller (:meth:`run_until_idle`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Optional

import torch

from glm5_core.ops import _checks
from glm5_core.rl.device import module_device
from glm5_core.rl.serving import kv_slots, replay_trace
from glm5_core.rl.serving.decode_threads import DecodeThreads
from glm5_core.rl.serving.prefix_cache import TrajectoryPrefixCache
from glm5_core.rl.serving.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    GenerateResult,
    Limits,
)
from glm5_core.rl.serving.sampling import sample
from glm5_core.rl.serving.speculative import SpeculativeDecoder, parse_setting


@dataclasses.dataclass
class EngineStats:
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    busy_seconds: float = 0.0
    prefill_seconds: float = 0.0  # part of busy_seconds spent in prefill forwards (incl. prefix-cache copies)
    prefill_tokens: int = 0  # positions actually computed by prefill
    cached_tokens: int = 0  # positions reused from the prefix cache
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_slot_steps: int = 0  # sum over decode steps of active slots (occupancy = this / (steps * S))
    requests: int = 0
    weight_updates: int = 0

    def as_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["uptime_seconds"] = time.monotonic() - self.started_at
        return d


@dataclasses.dataclass
class _Active:
    request: GenerateRequest
    future: concurrent.futures.Future
    tokens: list[int]  # context + generated so far
    kv_len: int  # positions of ``tokens`` already in the cache
    cached: int
    kv_version: int  # oldest weight version any of the slot's cached positions was computed under
    outputs: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    topk: list[list[list[int]]] = dataclasses.field(default_factory=list)
    generator: Optional[torch.Generator] = None  # the request's own stream (its sampling_seed); None: shared


class RolloutEngine:
    def __init__(self, model, *, max_batch: int = 8, max_len: Optional[int] = None, prefix_cache_entries: int = 256,
                 prefix_cache_tokens: Optional[int] = None, seed: int = 0, weight_version: int = 0,
                 record_topk: bool = False, max_new_tokens_cap: int = 1024, reuse_stacked_weights: bool = True,
                 decode_threads: int = 1, speculative: Optional[dict] = None, record_routing: bool = False,
                 record_index_topk: bool = False):
        config = model.config
        draft_tokens = parse_setting(speculative)
        # GLM-5.3 (KDA layers): their state is the state after a row's tokens, not per position, so a trajectory's
        # prefix cannot be reused from the prefix cache nor drafted by the MTP layer's row caches
        self._hybrid = bool(getattr(config, "is_hybrid", False))
        if self._hybrid and draft_tokens is not None:
            raise ValueError("speculative: expected none for a model with KDA layers (GLM-5.3: the drafts' "
                             "rejected tokens would have to be rolled back out of the recurrent state)")
        if self._hybrid and record_index_topk:
            raise ValueError("record_index_topk: expected False for a model with KDA layers (GLM-5.3: its k-pool "
                             "indexer's selection is not replayed; record_routing is)")
        if self._hybrid:
            prefix_cache_entries, prefix_cache_tokens = 0, None
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: expected an int >= 1, got {max_batch!r}")
        max_len = int(max_len or config.max_position_embeddings)
        if not 2 <= max_len <= config.max_position_embeddings:
            raise ValueError(f"max_len: expected an int in [2, {config.max_position_embeddings}], got {max_len}")
        self.model = model.eval()
        if reuse_stacked_weights:  # the MoE layers keep their stacked expert weights between decode steps
            model.reuse_stacked_expert_weights(True)  # (dropped on every push; see MoE._stacked)
        self.device = module_device(model)
        # decode steps on cpu: one intra-op thread per decoding thread (decode_threads.py says why)
        self._decoders = DecodeThreads(decode_threads, intra_op_threads=1 if self.device.type == "cpu" else None)
        self.max_batch = max_batch
        self.max_len = max_len
        self.limits = Limits(vocab_size=config.vocab_size, max_input_tokens=max_len - 1,
                             max_new_tokens=min(max_new_tokens_cap, max_len - 1))
        self.record_topk = record_topk
        # replay traces kept in the KV cache, returned to requests that ask (return_routed_experts / _indexer_topk)
        self.record = {"routing": bool(record_routing), "index_topk": bool(record_index_topk)}
        self.version = int(weight_version)
        self._newest_version = self.version  # the newest version accepted by update_weights
        self.stats = EngineStats()
        self.prefix_cache = TrajectoryPrefixCache(prefix_cache_entries, prefix_cache_tokens)
        self._cache = self._new_cache(max_batch)
        self._param_names = frozenset(model.state_dict())
        self._slots: list[Optional[_Active]] = [None] * max_batch
        self._waiting: collections.deque[tuple[GenerateRequest, concurrent.futures.Future]] = collections.deque()
        self._cond = threading.Condition()
        self._pending_weights: list[tuple[dict[str, torch.Tensor], int, threading.Event]] = []  # in arrival order
        self._paused = False
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.failure: Optional[BaseException] = None  # what stopped the scheduler thread, if anything did
        self._aborted: set = set()  # futures of running requests whose callers gave up (see abort)
        self._step_lock = threading.Lock()  # held by the scheduler for one step
        # MTP speculative decoding (``speculative={"draft_tokens": d}``; off by default)
        self.speculative = (SpeculativeDecoder(model, draft_tokens, max_batch, max_len)
                            if draft_tokens is not None else None)

    # -- public API ---------------------------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        if len(request.input_ids) > self.limits.max_input_tokens:
            raise ValueError(f"input_ids: expected at most {self.limits.max_input_tokens} tokens, "
                             f"got {len(request.input_ids)}")
        for name, kind in (("return_routed_experts", "routing"), ("return_indexer_topk", "index_topk")):
            if getattr(request, name) and not self.record[kind]:
                raise ValueError(f"{name}: this engine does not record them (start it with record_{kind}=True)")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            self._raise_if_failed()
            self._waiting.append((request, future))
            self._cond.notify_all()
        return future

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, *, partial: bool = False,
                       wait: Optional[float] = None) -> None:
        """Queue new weights; they replace the current ones before the next scheduler step (also while paused).
        ``partial``: ``state_dict`` is one bucket of the weights (any subset of the names). ``wait``: block up to
        that many seconds until the scheduler applied them (``TimeoutError`` otherwise)."""
        expected = self.model.state_dict()
        missing = [] if partial else sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise ValueError(f"state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(f"state_dict[{name!r}]: expected shape {tuple(expected[name].shape)}, "
                                 f"got {tuple(tensor.shape)}")
        floats = [(name, t) for name, t in state_dict.items() if t.is_floating_point()]
        flags = [torch.isfinite(t).all() for _, t in floats]
        if len({f.device for f in flags}) > 1:
            flags = [f.cpu() for f in flags]
        finite = torch.stack(flags) if flags else torch.ones(0, dtype=torch.bool)
        if not bool(finite.all()):  # one host sync per push (tensors on one device), not one per tensor
            name = floats[int((~finite).nonzero()[0])][0]
            raise ValueError(f"state_dict[{name!r}]: expected finite values, got NaN or inf")
        with self._cond:
            self._raise_if_failed()
            if int(version) < self._newest_version:
                raise ValueError(f"weight_version: expected >= {self._newest_version} (versions only move forward), "
                                 f"got {version}")
            self._newest_version = int(version)  # accepted: later pushes compare with it, even mid-apply
            applied = threading.Event()
            self._pending_weights.append((state_dict, int(version), applied))
            self._cond.notify_all()
        if self._thread is None:
            self._apply_pending_weights()
        elif wait is not None and not applied.wait(wait):
            raise TimeoutError(f"weights of version {version} not applied within {wait}s")

    def pause(self, mode: str = "in_place") -> int:
        """Stop scheduling after the current step (SGLang's ``/pause_generation``). ``in_place`` keeps running
        requests in their slots; ``abort`` finishes them (and the waiting ones) with ``finish_reason`` abort.
        Returns the number of requests held in place or aborted."""
        if mode not in ("in_place", "abort"):
            raise ValueError(f"mode: expected 'in_place' or 'abort', got {mode!r:.80}")
        with self._cond:
            self._paused = True
            self._cond.notify_all()
            if mode == "abort":
                for future in [s.future for s in self._slots if s is not None]:
                    self._aborted.add(future)
                waiting, self._waiting = list(self._waiting), collections.deque()
        if mode == "abort":
            for request, future in waiting:
                if future.set_running_or_notify_cancel():
                    future.set_result(GenerateResult(request.rid, [], [], [], FINISH_ABORT, len(request.input_ids), 0))
            self._abort_paused_slots()
            return len(waiting) + self.num_active()
        return self.num_active()

    def _abort_paused_slots(self) -> None:
        """Finish the flagged slots now (the scheduler does not step while paused). Runs under the scheduler
        lock only between steps: ``pause`` waits for the step in progress (``_step_lock``)."""
        with self._step_lock:
            for slot, state in enumerate(self._slots):
                if state is not None and state.future in self._aborted:
                    self._finish(slot, FINISH_ABORT)

    def resume(self) -> None:
        """Continue scheduling (SGLang's ``/continue_generation``)."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def newest_version(self) -> int:
        """The newest version accepted by :meth:`update_weights` (maybe not applied yet)."""
        return self._newest_version

    @property
    def paused(self) -> bool:
        return self._paused

    def end_trajectory(self, rid: str) -> None:
        """The trajectory ``rid`` is over (like closing an SGLang session): free its prefix-cache entry now
        instead of leaving dead KV to push live trajectories out of the cache."""
        self.prefix_cache.drop(rid)

    def abort(self, future: concurrent.futures.Future) -> None:
        """Stop the request behind ``future`` (its caller gave up, e.g. an HTTP timeout): a waiting request is
        dropped, a running one finishes with ``finish_reason`` abort at the next step, freeing its slot."""
        if future.cancel():  # it was waiting: take it out of the queue now
            with self._cond:
                self._waiting = collections.deque(item for item in self._waiting if item[1] is not future)
        elif not future.done():  # running: flag it for the scheduler
            with self._cond:
                self._aborted.add(future)
                if future.done():  # it finished meanwhile: nothing left to stop
                    self._aborted.discard(future)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"engine scheduler failed: {type(self.failure).__name__}: {self.failure}")

    def healthy(self) -> bool:
        """False once the scheduler thread has failed or exited: a supervisor should replace this engine."""
        if self.failure is not None:
            return False
        return self._thread is None or self._thread.is_alive() or self._stopping

    def num_active(self) -> int:
        return sum(s is not None for s in self._slots)

    def has_work(self) -> bool:
        return bool(self._waiting) or self.num_active() > 0

    def start(self) -> RolloutEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._decoders.close()
        for state in [s for s in self._slots if s is not None]:
            self._finish_result(state, FINISH_ABORT)
        while self._waiting:
            request, future = self._waiting.popleft()
            if future.set_running_or_notify_cancel():
                future.set_result(GenerateResult(request.rid, [], [], [], FINISH_ABORT, len(request.input_ids), 0))

    def run_until_idle(self) -> None:
        """Drive the scheduler from the calling thread until no work is left (no scheduler thread)."""
        while self.has_work():
            self.step()

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        futures = [self.submit(r) for r in requests]
        if self._thread is None:
            self.run_until_idle()
        return [f.result() for f in futures]

    # -- scheduler ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending_weights and \
                        (self._paused or (not self._waiting and self.num_active() == 0)):
                    self._cond.wait(timeout=0.5)
                if self._stopping:
                    return
                paused = self._paused
            try:
                with self._step_lock:
                    if paused:  # weights land while paused; nothing is scheduled
                        self._apply_pending_weights()
                    else:
                        self.step()
            except Exception as exc:  # a poisoned step (e.g. NaN logits): fail every request, never hang them
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self.failure = exc
            waiting, self._waiting = list(self._waiting), collections.deque()
        for slot, state in enumerate(self._slots):
            if state is not None:
                self._slots[slot] = None
                if not state.future.done():
                    state.future.set_exception(exc)
        for _, future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)
        with self._cond:
            self._aborted.clear()
        self.prefix_cache.flush()

    def _apply_pending_weights(self) -> None:
        with self._cond:
            pending, self._pending_weights = self._pending_weights, []
        for state_dict, version, applied in pending:
            with torch.no_grad():
                if len(state_dict) == len(self._param_names):
                    self.model.load_state_dict(state_dict, strict=True)
                else:  # one bucket: copy into the named tensors in place
                    current = self.model.state_dict()
                    for name, tensor in state_dict.items():
                        current[name].copy_(tensor)
            self.model.drop_stacked_expert_weights()  # never decode with a stacked copy of the old experts
            self.version = version
            self.prefix_cache.flush()
            self.stats.weight_updates += 1
            applied.set()

    @torch.inference_mode()  # no autograd bookkeeping at all (~6% of a batch-1 decode step); the engine's
    def step(self) -> None:  # own tensors (scratch and prefix caches, kept expert stacks) are inference tensors
        """Apply pending weights, admit waiting requests into free slots (prefill), decode one token."""
        t0 = time.monotonic()
        self._apply_pending_weights()
        admitted = []
        with self._cond:
            free = [slot for slot in range(self.max_batch) if self._slots[slot] is None]
            while free and self._waiting:
                request, future = self._waiting.popleft()
                if future.set_running_or_notify_cancel():  # False: its caller gave up while it waited
                    admitted.append((free.pop(0), request, future))
        if admitted:
            t_prefill = time.monotonic()
            try:
                self._prefill(admitted)
            except Exception as exc:  # requests no longer waiting and maybe not in a slot yet: fail them here
                for _, _, future in admitted:
                    if not future.done():
                        future.set_exception(exc)
                raise
            self.stats.prefill_seconds += time.monotonic() - t_prefill
        decoded = self.num_active() > 0
        if decoded:
            self._decode()
        if admitted or decoded:
            self.stats.busy_seconds += time.monotonic() - t0

    def _new_cache(self, rows: int):
        return self.model.new_cache(rows, self.max_len, record_routing=self.record["routing"],
                                    record_index_topk=self.record["index_topk"])

    def _forward(self, input_ids: torch.Tensor, cache, start_pos):
        # The engine builds every op input itself (token ids checked at submit, positions from its own
        # bookkeeping): the per-op value checks (a device sync each) would only slow the decode loop.
        with _checks.skip_value_checks():
            return self.model(input_ids, attention="sparse", cache=cache, start_pos=start_pos)

    def _prefill(self, admitted: list[tuple[int, GenerateRequest, concurrent.futures.Future]]) -> None:
        """Prefill newly admitted requests together: a scratch cache of one row per request receives each
        trajectory's cached prefix, one right-padded forward computes the rest (ragged ``start_pos``), and the
        rows are copied into the requests' slots."""
        k = len(admitted)
        if self._hybrid and k > 1 and len({len(r.input_ids) for _, r, _ in admitted}) > 1:
            for item in admitted:  # KDA layers: a right-padded row's state would take in its padding
                self._prefill([item])
            return
        reuse = []
        scratch = self._new_cache(k)
        main_fields = len(kv_slots.tensors(scratch))
        draft_rows = []  # per row: the MTP layer's cached rows (speculative decoding stores them after the main ones)
        for row, (_, request, _) in enumerate(admitted):
            n, entry = self.prefix_cache.lookup(request.rid, request.input_ids, min_version=self.version)
            if entry is not None:
                kv_slots.write_rows(scratch, row, entry.tensors[:main_fields], n)
            draft_rows.append(entry.tensors[main_fields:] if entry is not None else [])
            reuse.append(n)
        new_lens = [len(r.input_ids) - n for (_, r, _), n in zip(admitted, reuse)]
        T = max(new_lens)
        if k > 1 and max(reuse) + T > self.max_len:  # the padded window would overrun the cache: one by one
            for item in admitted:
                self._prefill([item])
            return
        for _, request, _ in admitted:  # the KV moves into the slot (a superset, stored back at finish): a copy
            self.prefix_cache.drop(request.rid)  # left in the cache would only take room from waiting trajectories
        ids = torch.zeros(k, T, dtype=torch.long)  # [k, T] right-padded new tokens, built on the host
        for row, ((_, request, _), n) in enumerate(zip(admitted, reuse)):
            ids[row, :new_lens[row]] = torch.tensor(request.input_ids[n:], dtype=torch.long)
        start = reuse[0] if len(set(reuse)) == 1 else torch.tensor(reuse, dtype=torch.long, device=self.device)
        out = self._forward(ids.to(self.device), scratch, start)
        last = torch.tensor(new_lens, dtype=torch.long) - 1  # [k] last real position per row
        logits = out.logits[torch.arange(k, device=self.device), last.to(self.device)]  # [k, V]
        slots, topk = [], []
        for row, ((slot, request, future), n) in enumerate(zip(admitted, reuse)):
            kv_slots.write_rows(self._cache, slot, kv_slots.read_rows(scratch, row, len(request.input_ids)),
                                len(request.input_ids))
            # the reused prefix passed lookup(min_version=self.version): all of the slot's KV is current
            self._slots[slot] = _Active(request, future, list(request.input_ids), kv_len=len(request.input_ids),
                                        cached=n, kv_version=self.version, generator=self._request_generator(request))
            self.stats.prefill_tokens += new_lens[row]
            self.stats.cached_tokens += n
            self.stats.requests += 1
            slots.append(slot)
            topk.append([t[row, int(last[row])].tolist() for t in out.topk_idx] if self.record_topk else None)
        self._accept_many(slots, logits, topk)
        if self.speculative is not None:  # rows still running: the MTP layer reads their prefill hidden states
            running = [row for row, slot in enumerate(slots) if self._slots[slot] is not None]
            self.speculative.after_prefill([(slots[row], self._slots[slots[row]].tokens, reuse[row], draft_rows[row])
                                            for row in running], out.hidden[running])

    def _decode(self) -> None:
        """One token for every active slot. The active slots are cut into up to ``decode_threads`` contiguous
        groups decoded concurrently (``decode_threads.py``); each group's forward covers only the window of
        slots from its first to its last (free slots are taken lowest first, so usually just its own): a view
        of those rows of the batched cache, never all ``max_batch`` of them. Sampling then runs once, over
        the active slots in slot order."""
        if self.speculative is not None:
            return self._decode_speculative()
        active = [i for i, s in enumerate(self._slots) if s is not None]
        parts = self._decoders.map(self._decode_group, self._decoders.groups(active))
        for i in active:
            self._slots[i].kv_len += 1  # versions only grow: the slot's oldest KV version is unchanged
        self.stats.decode_steps += 1
        self.stats.decode_slot_steps += len(active)
        logits = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])  # [A, V]
        self._accept_many(active, logits, [tk for p in parts for tk in p[1]])

    def _decode_group(self, group: list[int]) -> tuple[torch.Tensor, list]:
        """Forward the last token of the slots ``group`` (ascending) over their cache window: (logits [G, V],
        per slot its top-k trace or None)."""
        lo, hi = group[0], group[-1] + 1
        last = torch.zeros(hi - lo, 1, dtype=torch.long)  # [W, 1] over the window's W = hi - lo slots
        pos = torch.zeros(hi - lo, dtype=torch.long)  # [W]
        for slot in group:
            last[slot - lo, 0] = self._slots[slot].tokens[-1]
            pos[slot - lo] = self._slots[slot].kv_len
        start = int(pos[0]) if hi - lo == 1 else pos.to(self.device)
        # a window over every slot is the cache itself (no per-step views of each layer's tensors)
        window = self._cache if hi - lo == self.max_batch else kv_slots.row_window(self._cache, lo, hi)
        out = self._forward(last.to(self.device), window, start)
        rows = [slot - lo for slot in group]  # [G] rows of the window
        logits = out.logits[:, 0] if len(rows) == hi - lo else out.logits[torch.tensor(rows, device=self.device), 0]
        topk = [[t[r, 0].tolist() for t in out.topk_idx] for r in rows] if self.record_topk else [None] * len(rows)
        return logits, topk

    def _request_generator(self, request: GenerateRequest) -> Optional[torch.Generator]:
        if request.sampling_seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(request.sampling_seed)

    def _sample_rows(self, states: list[_Active], logits_BV: torch.Tensor) -> tuple[list[int], list[float]]:
        """One token and its log-prob per row: the shared generator draws for the unseeded rows together, each
        seeded row draws from its own generator."""
        temperature = torch.tensor([s.request.temperature for s in states], dtype=torch.float32, device=self.device)
        top_p = torch.tensor([s.request.top_p for s in states], dtype=torch.float32, device=self.device)
        tokens, logprobs = [0] * len(states), [0.0] * len(states)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            rows = torch.tensor(shared, dtype=torch.long, device=self.device)
            drawn, logp = sample(logits_BV[rows], temperature[rows], top_p[rows], self._generator)
            for i, tok, lp in zip(shared, drawn.tolist(), logp.tolist()):
                tokens[i], logprobs[i] = tok, lp
        for i, state in enumerate(states):
            if state.generator is not None:
                drawn, logp = sample(logits_BV[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], state.generator)
                tokens[i], logprobs[i] = int(drawn[0]), float(logp[0])
        return tokens, logprobs

    def _decode_speculative(self) -> None:
        """One draft-verify-accept step for all active slots; each emits 1..d+1 tokens (see ``speculative``)."""
        steps = self.speculative.step(self._slots, self._cache, self._forward, self._generator, self.record_topk)
        self.stats.decode_steps += 1
        self.stats.decode_slot_steps += len(steps)
        for slot, row in steps.items():
            state = self._slots[slot]
            for tok, lp, tk in zip(row.tokens, row.logprobs, row.topk):
                state.kv_len += 1  # the token before ``tok`` now has verified KV
                if self._emit(slot, state, tok, lp, tk):
                    break

    def _accept_many(self, slots: list[int], logits_BV: torch.Tensor, topk: list) -> None:
        states = [self._slots[i] for i in slots]
        tokens, logprobs = self._sample_rows(states, logits_BV)
        for slot, state, tok, lp, tk in zip(slots, states, tokens, logprobs, topk):
            self._emit(slot, state, tok, lp, tk)

    def _emit(self, slot: int, state: _Active, tok: int, lp: float, tk) -> bool:
        """Append one sampled token to the slot's request; finish it if it is done. Returns True if it finished."""
        state.tokens.append(tok)
        state.outputs.append(tok)
        state.logprobs.append(lp)
        state.versions.append(self.version)
        if tk is not None:
            state.topk.append(tk)
        self.stats.generated_tokens += 1
        if state.future in self._aborted:
            self._finish(slot, FINISH_ABORT)
        elif tok in state.request.stop_token_ids:
            self._finish(slot, FINISH_STOP)
        elif len(state.outputs) >= state.request.max_new_tokens or len(state.tokens) >= self.max_len:
            self._finish(slot, FINISH_LENGTH)
        else:
            return False
        return True

    def _finish(self, slot: int, reason: str) -> None:
        state = self._slots[slot]
        self._slots[slot] = None
        if state.kv_version < self.version:  # KV (partly) from replaced weights: never reuse it
            self.prefix_cache.drop(state.request.rid)
        else:  # the last sampled token has no KV yet: the cache holds tokens[:kv_len]
            rows = kv_slots.read_rows(self._cache, slot, state.kv_len)
            if self.speculative is not None:  # the MTP layer's rows ride along (after the main layers')
                rows += self.speculative.read_rows(slot, state.kv_len)
            self.prefix_cache.store(state.request.rid, state.tokens[:state.kv_len], rows, version=state.kv_version)
        request, n = state.request, state.kv_len  # the cache holds every position but the last sampled token's
        routed = replay_trace.read(self._cache.expert_ids, slot, n) if request.return_routed_experts else None
        keys = replay_trace.read(self._cache.index_topk, slot, n) if request.return_indexer_topk else None
        self._finish_result(state, reason, routed, keys)

    def _finish_result(self, state: _Active, reason: str, routed_experts=None, indexer_topk=None) -> None:
        result = GenerateResult(state.request.rid, state.outputs, state.logprobs, state.versions, reason,
                                prompt_tokens=len(state.request.input_ids), cached_tokens=state.cached,
                                topk_trace=state.topk if self.record_topk else None,
                                routed_experts=routed_experts, indexer_topk=indexer_topk)
        if not state.future.done():
            state.future.set_result(result)
        if self._aborted:  # after set_result: an abort() racing with this finish sees the future done
            with self._cond:
                self._aborted.discard(state.future)
