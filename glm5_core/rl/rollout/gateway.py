"""Token-in-token-out (TITO) gateway.

The agent loop never hands text to the trainer: every generation request of a trajectory passes through
:meth:`TITOGateway.generate`, which records the context tokens the environment added (loss mask 0) and the
engine's sampled token ids with their log-probs and weight versions (loss mask 1), exactly as returned.
A request whose ``input_ids`` extend the recorded sequence appends to it; one that does not (the context
manager folded or dropped history) closes the current sample and opens a new one. Nothing is re-tokenised.

Weight versions come as SGLang sends them: ``meta_info.weight_version`` a string (``"default"`` before any
update: the checkpoint the engine started from, which is the trainer's version 0) or an int, and per-token
versions in SGLang's ``weight_versions`` spans (or ``token_weight_versions``, one per token, from older glm5
servers). With ``return_routed_experts`` / ``return_indexer_topk`` the gateway asks for the replay traces and
keeps the last response's (which covers the whole sample) on the sample, checked (``replay_trace.decode``).
The trainer's versions are ints; a version that is neither gives a ``ValueError`` naming the field.
"""
from __future__ import annotations

from typing import Any, Callable

from glm5_core.rl.rollout.trajectory import Sample
from glm5_core.rl.serving import replay_trace

GenerateFn = Callable[[str, dict], dict]  # (trajectory id, SGLang request) -> SGLang response
DEFAULT_VERSION = "default"  # SGLang's ServerArgs.weight_version before any update


def parse_weight_version(value: Any, where: str = "meta_info.weight_version") -> int:
    """A trainer version (int >= 0) from a server's weight version label."""
    if isinstance(value, str):
        if value == DEFAULT_VERSION:
            return 0
        if value.isdigit() and len(value) < 19:
            return int(value)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"{where}: expected a trainer version (an int >= 0, its decimal string, or "
                     f"{DEFAULT_VERSION!r}), got {value!r:.80}")


def token_versions(meta: dict, num_tokens: int) -> list[int]:
    """The version each output token was sampled under, from SGLang's ``weight_versions`` spans, the older
    ``token_weight_versions`` list, or ``weight_version`` for all of them."""
    spans = meta.get("weight_versions")
    if spans:
        out: list[int] = []
        for i, span in enumerate(spans):
            if not isinstance(span, dict) or span.get("start") != len(out) or not isinstance(span.get("end"), int):
                raise ValueError(f"meta_info.weight_versions[{i}]: expected contiguous spans, got {span!r:.80}")
            out += [parse_weight_version(span.get("version"), f"meta_info.weight_versions[{i}].version")] \
                * (span["end"] - span["start"])
        if len(out) != num_tokens:
            raise ValueError(f"meta_info.weight_versions: spans cover {len(out)} tokens, output has {num_tokens}")
        return out
    listed = meta.get("token_weight_versions")
    if listed:
        if len(listed) != num_tokens:
            raise ValueError(f"meta_info.token_weight_versions: {len(listed)} entries for {num_tokens} tokens")
        return [parse_weight_version(v, "meta_info.token_weight_versions") for v in listed]
    return [parse_weight_version(meta.get("weight_version"))] * num_tokens


def finish_type(reason: Any) -> str:
    """``finish_reason`` in SGLang's dict forms (``{"type": ..., "matched" | "length" | "message": ...}``)."""
    if isinstance(reason, dict):
        return str(reason.get("type"))
    return str(reason)


class TITOGateway:
    """Records one trajectory. ``generate_fn`` sends a request to an engine (through the router)."""

    def __init__(self, trajectory_id: str, generate_fn: GenerateFn, *, return_routed_experts: bool = False,
                 return_indexer_topk: bool = False):
        self.trajectory_id = trajectory_id
        self._generate_fn = generate_fn
        self._replay = {"routed_experts": bool(return_routed_experts), "indexer_topk": bool(return_indexer_topk)}
        self.samples: list[Sample] = [Sample()]
        self.num_requests = 0

    @property
    def current(self) -> Sample:
        return self.samples[-1]

    def generate(self, input_ids: list[int], sampling_params: dict) -> dict:
        """Send one generation request; returns the engine's response dict (with ``output_ids``)."""
        input_ids = [int(t) for t in input_ids]
        recorded = self.current.tokens
        if input_ids[:len(recorded)] != recorded:
            self.samples.append(Sample())  # context was rewritten: a new append-only sample
            recorded = self.current.tokens
        self.current.append(input_ids[len(recorded):], sampled=False)
        body = {"input_ids": input_ids, "sampling_params": dict(sampling_params), "return_logprob": True,
                "rid": self.trajectory_id}
        body.update({f"return_{name}": True for name, asked in self._replay.items() if asked})
        response = self._generate_fn(self.trajectory_id, body)
        output_ids = [int(t) for t in response["output_ids"]]
        logprob_entries = response["meta_info"]["output_token_logprobs"]
        if len(logprob_entries) != len(output_ids) or any(int(e[1]) != t for e, t in zip(logprob_entries, output_ids)):
            raise ValueError("engine response: output_token_logprobs do not match output_ids")
        versions = token_versions(response["meta_info"], len(output_ids))
        self.current.append(output_ids, sampled=True, logprobs=[float(e[0]) for e in logprob_entries],
                            versions=versions)
        self.current.finish_reasons.append(finish_type(response["meta_info"].get("finish_reason")))
        self._record_traces(response["meta_info"])
        self.num_requests += 1
        return response

    def _record_traces(self, meta: dict) -> None:
        """The replay traces of the sample's whole sequence (every token but the last), as the engine returned
        them; a response without one (e.g. aborted before it ran) leaves the sample without a trace."""
        rows = len(self.current.tokens) - 1
        for name, asked in self._replay.items():
            if asked:
                value = meta.get(name)
                trace = replay_trace.decode(value, f"meta_info.{name}", rows=rows) if value is not None else None
                setattr(self.current, name, trace)

    def finished_samples(self) -> list[Sample]:
        """Samples with at least one sampled token (a sample of pure context trains nothing)."""
        for s in self.samples:
            s.check()
        return [s for s in self.samples if s.num_generated]
