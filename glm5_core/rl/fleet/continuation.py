"""Aborted generations continued, as slime's partial rollouts do: a weight push pauses every engine in SGLang's
``abort`` mode (the one pause both 0.5.15 and 0.5.23 can flush the cache after), which ends each running request
with ``finish_reason`` abort and the tokens it had sampled. Those tokens are kept, stamped with the version that
sampled them; the request is sent again with them appended to ``input_ids`` and ``max_new_tokens`` reduced, and
the parts are merged into one answer in SGLang's shape, so callers see one generation whose ``weight_versions``
spans name both versions.
"""
from __future__ import annotations

from glm5_core.rl.serving.client import MalformedResponse


def continuation(request: dict, partial: dict) -> dict:
    """``request`` resumed after ``partial`` (an aborted answer): its tokens become context."""
    ids = list(partial.get("output_ids") or [])
    params = dict(request.get("sampling_params") or {})
    for key in ("max_new_tokens", "min_new_tokens"):
        if isinstance(params.get(key), int):
            params[key] = max(0, params[key] - len(ids))
    return {**request, "input_ids": list(request["input_ids"]) + ids, "sampling_params": params}


def _labels(meta: dict, n: int) -> list:
    """The version label of each of ``n`` output tokens, as the engine wrote it (spans, list, or one label)."""
    spans = meta.get("weight_versions")
    if spans:
        labels: list = []
        for span in spans:
            if not isinstance(span, dict) or not isinstance(span.get("start"), int) \
                    or not isinstance(span.get("end"), int):
                raise MalformedResponse(f"meta_info.weight_versions: expected spans, got {str(span)[:80]}")
            labels += [span.get("version")] * (span["end"] - span["start"])
        return labels
    if meta.get("token_weight_versions"):
        return list(meta["token_weight_versions"])
    return [meta.get("weight_version")] * n


def _spans(labels: list) -> list[dict]:
    spans: list[dict] = []
    for i, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def merge(parts: list[dict]) -> dict:
    """One answer from the answers of a request and its continuations (in order; all but the last aborted)."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    meta = dict(last["meta_info"])
    ids: list[int] = []
    labels: list = []
    logprobs: list = []
    for part in parts:
        part_ids = list(part.get("output_ids") or [])
        ids += part_ids
        labels += _labels(part["meta_info"], len(part_ids))
        logprobs += list(part["meta_info"].get("output_token_logprobs") or [])
    meta["weight_versions"] = _spans(labels)
    meta.pop("token_weight_versions", None)
    if any("output_token_logprobs" in p["meta_info"] for p in parts):
        meta["output_token_logprobs"] = logprobs
    meta["prompt_tokens"] = parts[0]["meta_info"].get("prompt_tokens", meta.get("prompt_tokens"))
    meta["completion_tokens"] = len(ids)
    meta["num_aborts"] = len(parts) - 1
    return {**last, "output_ids": ids, "meta_info": meta}
