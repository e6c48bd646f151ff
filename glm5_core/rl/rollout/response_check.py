"""What an engine's ``/generate`` answer must be before anything of it is recorded for training.

Engines are other processes, often other programs (SGLang); their answers are untrusted. :class:`ResponseCheck`
refuses, with :class:`~glm5_core.rl.serving.client.MalformedResponse`, an answer that no correct engine sends:

* ``output_ids`` missing, not a list of token ids, or an id outside ``[0, vocab_size)``;
* asked for log-probs (``return_logprob``): ``meta_info.output_token_logprobs`` missing, not one
  ``[logprob, token_id, ...]`` entry per output token, an entry's token not the output token, a log-prob that is
  null, not a finite number, or positive (above ``LOGPROB_EPS``: a log-probability is <= 0);
* a weight version label that is not a trainer version (``gateway.parse_weight_version``), spans that do not
  cover the output, or a version newer than the newest the trainer has pushed (``newest_version()``);
* a replay trace it was asked for (``return_routed_experts`` / ``return_indexer_topk``) that does not decode to
  one row per position of the sequence but the last.

What it cannot see: log-probs that are plausible but wrong (e.g. all shifted by a constant) need the policy's
own forward pass; the trainer's importance ratios (``train`` IS truncation) bound what such tokens can do.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from glm5_core.rl.rollout.gateway import token_versions
from glm5_core.rl.serving import replay_trace
from glm5_core.rl.serving.client import MalformedResponse

LOGPROB_EPS = 1e-3  # float32 log-softmax rounding can give a few ulps above 0, never more


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ResponseCheck:
    """``check(request, response)`` raises :class:`MalformedResponse` (without the server: the caller adds it)."""

    def __init__(self, *, vocab_size: int, newest_version: Callable[[], int]):
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size: expected an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.newest_version = newest_version

    def __call__(self, request: dict, response: Any) -> None:
        if not isinstance(response, dict) or not isinstance(response.get("meta_info"), dict):
            raise MalformedResponse("expected a JSON object with meta_info")
        meta = response["meta_info"]
        ids = response.get("output_ids")
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise MalformedResponse(f"output_ids: expected a list of token ids, got {str(ids)[:80]}")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise MalformedResponse(f"output_ids: token id {bad} outside the vocabulary [0, {self.vocab_size})")
        if request.get("return_logprob"):
            self._logprobs(meta.get("output_token_logprobs"), ids)
        self._versions(meta, len(ids))
        rows = len(request.get("input_ids") or []) + len(ids) - 1
        for name in ("routed_experts", "indexer_topk"):
            if request.get(f"return_{name}") and meta.get(name) is not None:
                try:
                    replay_trace.decode(meta[name], f"meta_info.{name}", rows=rows)
                except ValueError as exc:
                    raise MalformedResponse(str(exc)) from None

    @staticmethod
    def _logprobs(entries: Any, ids: list[int]) -> None:
        where = "meta_info.output_token_logprobs"
        if not isinstance(entries, list):
            raise MalformedResponse(f"{where}: expected a list, got {str(entries)[:80]}")
        if len(entries) != len(ids):
            raise MalformedResponse(f"{where}: {len(entries)} entries for {len(ids)} output tokens")
        for i, (entry, token) in enumerate(zip(entries, ids)):
            if not isinstance(entry, (list, tuple)) or len(entry) < 2:
                raise MalformedResponse(f"{where}[{i}]: expected [logprob, token_id, ...], got {str(entry)[:80]}")
            logprob = entry[0]
            if not isinstance(logprob, (int, float)) or isinstance(logprob, bool) or not math.isfinite(logprob):
                raise MalformedResponse(f"{where}[{i}]: expected a finite log-prob, got {logprob!r:.40}")
            if logprob > LOGPROB_EPS:
                raise MalformedResponse(f"{where}[{i}]: a log-prob is <= 0, got {logprob}")
            if entry[1] != token:
                raise MalformedResponse(f"{where}[{i}]: token {entry[1]!r:.40} is not output_ids[{i}] = {token}")

    def _versions(self, meta: dict, num_tokens: int) -> None:
        try:
            versions = token_versions(meta, num_tokens)
            if meta.get("weight_version") is not None:
                versions = versions + token_versions({"weight_version": meta["weight_version"]}, 1)
        except (ValueError, TypeError) as exc:
            raise MalformedResponse(str(exc)) from None
        newest = self.newest_version()
        future = next((v for v in versions if v > newest), None)
        if future is not None:
            raise MalformedResponse(f"weight version {future} is newer than the newest pushed ({newest})")
