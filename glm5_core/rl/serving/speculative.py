"""MTP speculative decoding for the rollout engine (``speculative: {draft_tokens: d}``).

Legend: S engine slots, d draft tokens, L max_len, D hidden_size, V vocabulary, n a row's token count
(context + generated; the main cache holds positions 0..n-2, the last sampled token has no KV yet).

The draft model is the model's own MTP layer applied recursively (chained), the way SGLang's EAGLE worker runs
DeepSeek-V3's / GLM-5's MTP layer with ``speculative_eagle_topk=1`` (one chain, no tree): read in SGLang's
``eagle_worker.py`` flow and the EAGLE x MLA notes: draft-extend, multi-step draft, target-verify. Per step:

1. draft-extend: the MTP layer runs on the main model's hidden states of the positions verified since the
   last step (``h[p]`` with ``embed(x[p+1])`` at position p, positions mtp_len..n-2), writing its own latent
   cache there; its output at n-2 predicts draft ``y_1`` (token n).
2. multi-step draft: ``d - 1`` one-token MTP steps, each fed the MTP's own previous output and the previous
   draft (position n-2+j), give ``y_2..y_d``. The MTP cache entries these write are provisional: the next
   draft-extend rewrites them from the main model's hidden states. (Training applies depth k at position t
   over depth-k keys; the chain instead advances the position over one cache, as SGLang's MTP drafting does.
   Either way only the acceptance rate depends on how good the drafts are.)
3. target-verify: one main forward over ``[x[n-1], y_1..y_d]`` at positions n-1..n-1+d against the latent
   cache (DSA as in plain decoding: each position's indexer top-k is computed against the same keys, so it is
   the one plain decoding selects), then :func:`speculative_sampling.accept_drafts` per row. Rows accept
   different counts; a row's cache "rolls back" by its length alone (slots past it are rewritten before any
   query can see them, as in plain decoding).

Cost per step (``benchmarks/bench_speculative.py --part costs``): one verify forward over d+1 positions and d
MTP forwards. The forwards cover only the window of slots from the first active one to the last (as plain
decoding's do) and pass one int start position when every row of the window has the same one (always at batch 1:
the main model's int fast paths); a step's random numbers are drawn once, 2 * draft_tokens + 1 per row
(:meth:`SpeculativeDecoder._uniforms`), and all rows sample in batched calls. A row drafts no more than it can
still emit (its own limit; rows of one step may differ).

The MTP layer keeps its own one-layer latent cache of S rows (``L + d + 1`` positions: provisional draft
entries may run past the main cache). A finished request's MTP rows are stored in the prefix cache after its
main-layer rows, so a later turn drafts over the reused prefix too.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Callable, Optional

import torch

from glm5_core.model.cache import KVCache, StartPos
from glm5_core.model.rope import positions_of
from glm5_core.model.state import ForwardState
from glm5_core.ops import _checks
from glm5_core.rl.config import MAX_DRAFT_TOKENS, parse_setting  # noqa: F401 (importable here too)
from glm5_core.rl.serving import kv_slots
from glm5_core.rl.serving.sampling import GREEDY_BELOW
from glm5_core.rl.serving.speculative_sampling import accept_drafts, draw, full_logprobs, sampling_probs


def check_draft_model(model, key: str = "speculative") -> None:
    """ValueError unless ``model`` holds MTP weights to draft with."""
    if model.model.mtp is None:
        why = getattr(model, "mtp_absent_reason", None) or "its config has num_nextn_predict_layers=0"
        raise ValueError(f"{key}: expected a model with MTP weights (the draft model), but it has none: {why}")


class _MTPLayerCache:
    """A one-layer KVCache that the MTP attention addresses by its own layer index (num_hidden_layers)."""

    def __init__(self, layer_idx: int, cache: KVCache):
        self.layer_idx = layer_idx
        self.cache = cache

    def write_latent(self, layer: int, c_kv, k_pe, start_pos: StartPos):
        assert layer == self.layer_idx, f"MTP cache written by layer {layer}"
        return self.cache.write_latent(0, c_kv, k_pe, start_pos)

    def write_index_keys(self, layer: int, index_k, start_pos: StartPos):
        assert layer == self.layer_idx, f"MTP cache written by layer {layer}"
        return self.cache.write_index_keys(0, index_k, start_pos)


def new_mtp_cache(model, batch_size: int, length: int) -> KVCache:
    cfg = model.config
    weight = model.model.embed_tokens.weight

    def zeros(width: int) -> torch.Tensor:
        return torch.zeros(batch_size, length, width, dtype=weight.dtype, device=weight.device)

    has_indexer = model.model.mtp.self_attn.indexer is not None
    return KVCache(c_kv=[zeros(cfg.kv_lora_rank)], k_pe=[zeros(cfg.qk_rope_head_dim)],
                   index_k=[zeros(cfg.index_head_dim) if has_indexer else None])


def mtp_forward(model, cache: KVCache, hidden: torch.Tensor, next_ids: torch.Tensor,
                start_pos: torch.Tensor) -> torch.Tensor:
    """One MTP application over a cache: hidden [B, T, D] (main model's or the MTP's previous output), next_ids
    [B, T] (the token after each position), start_pos [B] -> the MTP's hidden [B, T, D]."""
    mtp = model.model.mtp
    B, T = next_ids.shape
    cos, sin = model.model.rotary(positions_of(start_pos, B, T, next_ids.device), hidden.dtype)
    state = ForwardState(attention="sparse", start_pos=start_pos, cache=_MTPLayerCache(mtp.self_attn.layer_idx, cache),
                         indexer_loss=False, cos=cos, sin=sin, record_topk=False,
                         expert_counts=[None] * model.num_moe_layers)
    with _checks.skip_value_checks():
        return mtp.predict(hidden, model.model.embed_tokens(next_ids), state)


def mtp_logits(model, mtp_hidden: torch.Tensor) -> torch.Tensor:
    """The MTP's next-token logits (its own final norm, the model's lm_head): [..., D] -> fp32 [..., V]."""
    return model._logits(model.model.mtp.shared_head.norm(mtp_hidden))


@dataclasses.dataclass
class RowStep:
    """What one speculative step emits for one row (drafts accepted, then the corrected / bonus token)."""
    tokens: list[int]
    logprobs: list[float]
    topk: list[Optional[list[list[int]]]]


@dataclasses.dataclass
class SpecStats:
    row_steps: int = 0  # (row, verify step) pairs
    drafted: int = 0
    accepted: int = 0

    def mean_acceptance_length(self) -> float:
        """Tokens a row gets per verify step (accepted drafts + 1), the figure GLM-5 reports."""
        return 1.0 + self.accepted / self.row_steps if self.row_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "mean_acceptance_length": self.mean_acceptance_length()}


class SpeculativeDecoder:
    """The engine's speculative decode step. Per slot it keeps the main hidden states the MTP layer has not
    consumed yet (positions ``mtp_len[slot]..n-2``)."""

    def __init__(self, model, draft_tokens: int, max_batch: int, max_len: int):
        check_draft_model(model)
        self.model = model
        self.draft_tokens = draft_tokens
        self.max_len = max_len
        self.device = model.model.embed_tokens.weight.device
        self.cache_len = max_len + draft_tokens + 1
        self.cache = new_mtp_cache(model, max_batch, self.cache_len)
        self.pending: list[Optional[torch.Tensor]] = [None] * max_batch  # [m, D] main hidden not yet drafted from
        self.mtp_len = [0] * max_batch
        self.stats = SpecStats()

    # -- prefill ---------------------------------------------------------------------------------------
    def after_prefill(self, rows: Sequence[tuple[int, list[int], int, list[torch.Tensor]]],
                      hidden: torch.Tensor) -> None:
        """Rows just prefilled: (slot, context tokens incl. the sampled first token, reused prefix length, the MTP
        rows the prefix cache kept for that prefix or []); hidden [k, T, D] holds the prefill's main hidden states
        from each row's reused length on. The MTP layer fills its cache over positions reuse..P-2 (P prompt
        tokens) on top of the reused rows; position P-1 waits for the first decode step."""
        if not rows:  # every admitted request finished at its first token
            return
        T = max(len(tokens) - 1 - reuse for _, tokens, reuse, _ in rows) - 1  # MTP positions to compute, padded
        length = max([len(tokens) - 1 for _, tokens, _, _ in rows] + [reuse + T for _, _, reuse, _ in rows])
        scratch = new_mtp_cache(self.model, len(rows), max(length, 1))  # the padded window fits every row
        h = hidden.new_zeros(len(rows), max(T, 1), hidden.shape[-1])  # [k, T, D] right-padded
        ids = torch.zeros(len(rows), max(T, 1), dtype=torch.long)  # [k, T] the token after each position
        for row, (slot, tokens, reuse, cached) in enumerate(rows):
            P = len(tokens) - 1
            if cached:
                kv_slots.write_rows(scratch, row, cached, reuse)
            h[row, :P - 1 - reuse] = hidden[row, :P - 1 - reuse]
            ids[row, :P - 1 - reuse] = torch.tensor(tokens[reuse + 1:P], dtype=torch.long)
            self.pending[slot] = hidden[row, P - 1 - reuse:P - reuse]  # [1, D] position P-1
            self.mtp_len[slot] = P - 1
        if T > 0:
            start = torch.tensor([reuse for _, _, reuse, _ in rows], dtype=torch.long, device=self.device)
            mtp_forward(self.model, scratch, h, ids.to(self.device), start)
        for row, (slot, tokens, _, _) in enumerate(rows):
            kv_slots.write_rows(self.cache, slot, kv_slots.read_rows(scratch, row, len(tokens) - 2), len(tokens) - 2)

    def read_rows(self, slot: int, length: int) -> list[torch.Tensor]:
        """The slot's MTP rows for the prefix cache (positions past ``mtp_len`` hold provisional draft entries:
        a later turn that reuses them drafts from slightly different keys, which costs acceptance only)."""
        return kv_slots.read_rows(self.cache, slot, length)

    # -- one decode step -------------------------------------------------------------------------------
    def step(self, states: Sequence, main_cache, forward: Callable, generator: torch.Generator,
             record_topk: bool) -> dict[int, RowStep]:
        """Draft, verify and accept for every active slot (``states[slot]`` not None, with ``tokens``,
        ``request``, ``outputs``, ``generator``). Returns what each active slot emits; the caller appends it token
        by token. The forwards cover the window of slots from the first active one to the last (W rows)."""
        active = [i for i, s in enumerate(states) if s is not None]
        lo, hi = active[0], active[-1] + 1
        rows = [i - lo for i in active]  # [A] rows of the window
        W = hi - lo
        n = [len(states[i].tokens) for i in active]
        # a row's own draft limit: its room in the cache and its remaining tokens (its last step drafts no more
        # than it can emit); the step drafts the largest limit, as far as every row's room allows (so a row's
        # drafts depend on the other rows only while one of them is within draft_tokens of max_len)
        limits = [min(self.draft_tokens, self.max_len - n_i, max(1, states[i].request.max_new_tokens
                                                                 - len(states[i].outputs) - 1))
                  for i, n_i in zip(active, n)]
        d = min(max(limits), min(self.max_len - n_i for n_i in n))
        limits = [min(c, d) for c in limits]
        settings = [(1.0, 1.0)] * W  # (temperature, top_p) per window row; rows of free slots: placeholders
        for r, i in zip(rows, active):
            settings[r] = (states[i].request.temperature, states[i].request.top_p)
        temperature = torch.tensor([t for t, _ in settings], dtype=torch.float32, device=self.device)  # [W]
        # rows with top_p 1 keep every token: the nucleus filter (a sort) runs only if some row restricts it
        top_p = (torch.tensor([p for _, p in settings], dtype=torch.float32, device=self.device)
                 if any(p < 1 for _, p in settings) else None)
        any_greedy = any(t < GREEDY_BELOW for t, _ in settings)
        uniforms = self._uniforms(states, active, lo, W, generator)  # [W, 2 * draft_tokens + 1]
        # one start position for the whole window when every row has one (batch 1): the int fast paths
        same = W == len(active) and len(set(n)) == 1

        drafts, draft_probs = self._draft(states, active, lo, W, n, d, temperature, top_p, any_greedy,
                                          uniforms)  # [W, d], [W, d, V]
        last, pos = [[0]] * W, [0] * W  # per window row: its last token (no KV yet) and that token's position
        for r, i, n_i in zip(rows, active, n):
            last[r], pos[r] = [states[i].tokens[-1]], n_i - 1
        ids = torch.cat((torch.tensor(last, dtype=torch.long, device=self.device), drafts), dim=1)  # [W, d+1]
        start = pos[0] if same else torch.tensor(pos, dtype=torch.long, device=self.device)
        window = main_cache if W == main_cache.batch_size else kv_slots.row_window(main_cache, lo, hi)
        out = forward(ids, window, start)
        target_probs = sampling_probs(out.logits, temperature, top_p, any_greedy)  # [W, d+1, V]
        limit = None if min(limits) == d else torch.tensor(
            [limits[rows.index(r)] if r in rows else d for r in range(W)], dtype=torch.long, device=self.device)
        accept_u = torch.cat((uniforms[:, self.draft_tokens:self.draft_tokens + d], uniforms[:, -1:]), dim=1)
        tokens, accepted = accept_drafts(target_probs, drafts, draft_probs, uniforms=accept_u,
                                         limit=limit)  # [W, d+1], [W]
        logprobs = full_logprobs(out.logits, tokens, temperature)  # [W, d+1]

        tokens_l, accepted_l, logprobs_l = tokens.tolist(), accepted.tolist(), logprobs.tolist()
        topk_rows = [t.tolist() for t in out.topk_idx] if record_topk else None  # per layer [W][d+1][K]
        result = {}
        for r, i, n_i, limit_r in zip(rows, active, n, limits):
            k = accepted_l[r]
            self.pending[i] = out.hidden[r, :k + 1]  # positions n-1..n-1+k, verified
            self.mtp_len[i] = n_i - 1
            topk = [[layer[r][j] for layer in topk_rows] if topk_rows else None for j in range(k + 1)]
            result[i] = RowStep(tokens_l[r][:k + 1], logprobs_l[r][:k + 1], topk)
            self.stats.row_steps += 1
            self.stats.drafted += limit_r
            self.stats.accepted += k
        return result

    def _uniforms(self, states, active: list[int], lo: int, W: int, generator: torch.Generator) -> torch.Tensor:
        """Every random number the step uses, fp32 [W, 2 * draft_tokens + 1] per window row: the draws of its
        drafts, its acceptance tests, then its last token's draw. A request with a ``sampling_seed`` takes its
        row from its own generator, always that many numbers per step, so its tokens depend on its seed alone
        (and its logits); the other rows share ``generator``."""
        R = 2 * self.draft_tokens + 1
        shared = [i - lo for i in active if states[i].generator is None]
        if len(shared) == W:
            return torch.rand(W, R, generator=generator, device=self.device)
        u = torch.zeros(W, R, device=self.device)  # rows of free slots stay 0 (nothing reads them)
        if shared:
            u[shared] = torch.rand(len(shared), R, generator=generator, device=self.device)
        for i in active:
            if states[i].generator is not None:
                u[i - lo] = torch.rand(R, generator=states[i].generator, device=self.device)
        return u

    def _draft(self, states, active: list[int], lo: int, W: int, n: list[int], d: int, temperature: torch.Tensor,
               top_p: Optional[torch.Tensor], any_greedy: bool,
               uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-extend over each row's pending positions, then d - 1 chained steps, over the MTP cache rows of
        the window. Returns drafts int64 [W, d] and their distributions fp32 [W, d, V]."""
        pending = [self.pending[i] for i in active]  # [m_r, D] each
        m = [p.shape[0] for p in pending]
        T = max(m)
        ids: list[list[int]] = [[0] * T for _ in range(W)]  # [W, T] the token after each position
        starts = [0] * W
        for i, n_i in zip(active, n):
            tokens = states[i].tokens[self.mtp_len[i] + 1:n_i]
            ids[i - lo][:len(tokens)] = tokens
            starts[i - lo] = self.mtp_len[i]
        if W == len(active) and len(set(m)) == 1:  # every row of the window has T positions
            hidden = torch.stack(pending)  # [W, T, D]
        else:
            hidden = pending[0].new_zeros(W, T, pending[0].shape[-1])  # [W, T, D] right-padded
            for i, p in zip(active, pending):
                hidden[i - lo, :p.shape[0]] = p
        cache = self.cache if W == self.cache.batch_size else kv_slots.row_window(self.cache, lo, lo + W)
        ends = [starts[i - lo] + m_r for i, m_r in zip(active, m)]  # each row's next MTP position (n - 1)
        if W == len(active) and len(set(m)) == 1 and len(set(starts)) == 1:  # one start: the int fast paths
            start, last_pos = starts[0], ends[0]
            h = mtp_forward(self.model, cache, hidden, torch.tensor(ids, device=self.device), start)[:, -1:]
        else:
            start = torch.tensor(starts, dtype=torch.long, device=self.device)
            last = torch.tensor([m[active.index(r + lo)] - 1 if r + lo in active else 0 for r in range(W)],
                                device=self.device)  # [W] index of each row's last real position
            last_pos = start + last + 1  # [W] position n - 1
            h = mtp_forward(self.model, cache, hidden, torch.tensor(ids, device=self.device), start)
            h = h[torch.arange(W, device=self.device), last].unsqueeze(1)  # [W, 1, D] at position n-2
        logits = mtp_logits(self.model, h[:, 0])  # [W, V]
        drafts, probs = [], []
        for j in range(d):
            q = sampling_probs(logits, temperature, top_p, any_greedy)  # [W, V]
            y = draw(q, uniforms[:, j]).unsqueeze(1)  # [W, 1]
            drafts.append(y)
            probs.append(q)
            if j + 1 < d:  # position n-1+j: the MTP's own output and the draft just made
                h = mtp_forward(self.model, cache, h, y, last_pos + j)  # [W, 1, D]
                logits = mtp_logits(self.model, h[:, 0])
        return torch.cat(drafts, dim=1), torch.stack(probs, dim=1)
