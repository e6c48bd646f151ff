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

The MTP layer keeps its own one-layer latent cache of S rows (``L + d + 1`` positions: provisional draft
entries may run past the main cache). A finished request's MTP rows are stored in the prefix cache after its
main-layer rows, so a later turn drafts over the reused prefix too.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from glm5_core.model.cache import KVCache, StartPos
from glm5_core.model.rope import positions_of
from glm5_core.model.state import ForwardState
from glm5_core.ops import _checks
from glm5_core.rl.serving import kv_slots
from glm5_core.rl.serving.speculative_sampling import accept_drafts, full_logprobs, sampling_probs

MAX_DRAFT_TOKENS = 16


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
    tokens: List[int]
    logprobs: List[float]
    topk: List[Optional[List[List[int]]]]


@dataclasses.dataclass
class SpecStats:
    row_steps: int = 0  # (row, verify step) pairs
    drafted: int = 0
    accepted: int = 0

    def mean_acceptance_length(self) -> float:
        """Tokens a row gets per verify step (accepted drafts + 1), the figure GLM-5 reports."""
        return 1.0 + self.accepted / self.row_steps if self.row_steps else 0.0

    def as_dict(self) -> Dict[str, float]:
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
        self.pending: List[Optional[torch.Tensor]] = [None] * max_batch  # [m, D] main hidden not yet drafted from
        self.mtp_len = [0] * max_batch
        self.stats = SpecStats()

    # -- prefill ---------------------------------------------------------------------------------------
    def after_prefill(self, rows: Sequence[Tuple[int, List[int], int, List[torch.Tensor]]],
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

    def read_rows(self, slot: int, length: int) -> List[torch.Tensor]:
        """The slot's MTP rows for the prefix cache (positions past ``mtp_len`` hold provisional draft entries:
        a later turn that reuses them drafts from slightly different keys, which costs acceptance only)."""
        return kv_slots.read_rows(self.cache, slot, length)

    # -- one decode step -------------------------------------------------------------------------------
    def step(self, states: Sequence, main_cache, forward: Callable, generator: torch.Generator,
             record_topk: bool) -> Dict[int, RowStep]:
        """Draft, verify and accept for every active slot (``states[slot]`` not None, with ``tokens``,
        ``request``, ``outputs``). Returns what each active slot emits; the caller appends it token by token."""
        S = len(states)
        active = [i for i, s in enumerate(states) if s is not None]
        n = {i: len(states[i].tokens) for i in active}
        remaining = max(states[i].request.max_new_tokens - len(states[i].outputs) for i in active)
        d = min(self.draft_tokens, min(self.max_len - n[i] for i in active), max(1, remaining - 1))
        temperature = torch.ones(S, dtype=torch.float32)
        top_p = torch.ones(S, dtype=torch.float32)
        for i in active:
            temperature[i] = states[i].request.temperature
            top_p[i] = states[i].request.top_p
        # rows with top_p 1 keep every token: the nucleus filter (a sort) runs only if some row restricts it
        top_p = top_p.to(self.device) if bool((top_p < 1).any()) else None
        temperature = temperature.to(self.device)

        drafts, draft_probs = self._draft(states, active, n, d, temperature, top_p, generator)  # [S, d], [S, d, V]

        ids = torch.zeros(S, d + 1, dtype=torch.long)  # [S, d+1]: last token, then the drafts
        pos = torch.zeros(S, dtype=torch.long)
        for i in active:
            ids[i, 0] = states[i].tokens[-1]
            pos[i] = n[i] - 1
        ids = ids.to(self.device)
        ids[:, 1:] = drafts
        out = forward(ids, main_cache, pos.to(self.device))
        target_probs = sampling_probs(out.logits, temperature, top_p)  # [S, d+1, V]
        tokens, accepted = accept_drafts(target_probs, drafts, draft_probs, generator)
        logprobs = full_logprobs(out.logits, tokens, temperature)  # [S, d+1]

        tokens_l, accepted_l, logprobs_l = tokens.tolist(), accepted.tolist(), logprobs.tolist()
        topk_rows = [t.tolist() for t in out.topk_idx] if record_topk else None  # per layer [S][d+1][K]
        result = {}
        for i in active:
            k = accepted_l[i]
            self.pending[i] = out.hidden[i, :k + 1]  # positions n-1..n-1+k, verified
            self.mtp_len[i] = n[i] - 1
            topk = [[layer[i][j] for layer in topk_rows] if topk_rows else None for j in range(k + 1)]
            result[i] = RowStep(tokens_l[i][:k + 1], logprobs_l[i][:k + 1], topk)
            self.stats.row_steps += 1
            self.stats.drafted += d
            self.stats.accepted += k
        return result

    def _draft(self, states, active: List[int], n: Dict[int, int], d: int, temperature: torch.Tensor,
               top_p: torch.Tensor, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """Draft-extend over each row's pending positions, then d - 1 chained steps.
        Returns drafts int64 [S, d] and their distributions fp32 [S, d, V]."""
        S = len(states)
        D = self.model.config.hidden_size
        m = {i: self.pending[i].shape[0] for i in active}
        T = max(m.values())
        hidden = torch.zeros(S, T, D, dtype=self.pending[active[0]].dtype, device=self.device)  # [S, T, D]
        next_ids = torch.zeros(S, T, dtype=torch.long)  # [S, T]
        start = torch.zeros(S, dtype=torch.long)
        last = torch.zeros(S, dtype=torch.long)  # index of each row's last real position
        for i in active:
            hidden[i, :m[i]] = self.pending[i]
            next_ids[i, :m[i]] = torch.tensor(states[i].tokens[self.mtp_len[i] + 1:n[i]], dtype=torch.long)
            start[i] = self.mtp_len[i]
            last[i] = m[i] - 1
        start, last = start.to(self.device), last.to(self.device)
        h = mtp_forward(self.model, self.cache, hidden, next_ids.to(self.device), start)
        h = h[torch.arange(S, device=self.device), last].unsqueeze(1)  # [S, 1, D] at position n-2
        logits = mtp_logits(self.model, h[:, 0])  # [S, V]
        drafts, probs = [], []
        for j in range(d):
            q = sampling_probs(logits, temperature, top_p)  # [S, V]
            y = torch.multinomial(q, 1, generator=generator)  # [S, 1]
            drafts.append(y)
            probs.append(q)
            if j + 1 < d:  # position n-1+j: the MTP's own output and the draft just made
                h = mtp_forward(self.model, self.cache, h, y, start + last + 1 + j)  # [S, 1, D]
                logits = mtp_logits(self.model, h[:, 0])
        return torch.cat(drafts, dim=1), torch.stack(probs, dim=1)
