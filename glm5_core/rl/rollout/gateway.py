"""Token-in-token-out (TITO) gateway.

The agent loop never hands text to the trainer: every generation request of a trajectory passes through
:meth:`TITOGateway.generate`, which records the context tokens the environment added (loss mask 0) and the
engine's sampled token ids with their log-probs and weight versions (loss mask 1), exactly as returned.
A request whose ``input_ids`` extend the recorded sequence appends to it; one that does not (the context
manager folded or dropped history) closes the current sample and opens a new one. Nothing is re-tokenised.
"""
from __future__ import annotations

from typing import Callable, Dict, List

from glm5_core.rl.rollout.trajectory import Sample

GenerateFn = Callable[[str, Dict], Dict]  # (trajectory id, SGLang request) -> SGLang response


class TITOGateway:
    """Records one trajectory. ``generate_fn`` sends a request to an engine (through the router)."""

    def __init__(self, trajectory_id: str, generate_fn: GenerateFn):
        self.trajectory_id = trajectory_id
        self._generate_fn = generate_fn
        self.samples: List[Sample] = [Sample()]
        self.num_requests = 0

    @property
    def current(self) -> Sample:
        return self.samples[-1]

    def generate(self, input_ids: List[int], sampling_params: Dict) -> Dict:
        """Send one generation request; returns the engine's response dict (with ``output_ids``)."""
        input_ids = [int(t) for t in input_ids]
        recorded = self.current.tokens
        if input_ids[:len(recorded)] != recorded:
            self.samples.append(Sample())  # context was rewritten: a new append-only sample
            recorded = self.current.tokens
        self.current.append(input_ids[len(recorded):], sampled=False)
        response = self._generate_fn(self.trajectory_id, {
            "input_ids": input_ids, "sampling_params": dict(sampling_params), "return_logprob": True,
            "rid": self.trajectory_id,
        })
        output_ids = [int(t) for t in response["output_ids"]]
        logprob_entries = response["meta_info"]["output_token_logprobs"]
        if len(logprob_entries) != len(output_ids) or any(int(e[1]) != t for e, t in zip(logprob_entries, output_ids)):
            raise ValueError("engine response: output_token_logprobs do not match output_ids")
        version = int(response["meta_info"]["weight_version"])
        versions = response["meta_info"].get("token_weight_versions") or [version] * len(output_ids)
        self.current.append(output_ids, sampled=True, logprobs=[float(e[0]) for e in logprob_entries],
                            versions=[int(v) for v in versions])
        self.current.finish_reasons.append(str(response["meta_info"]["finish_reason"]["type"]))
        self.num_requests += 1
        return response

    def finished_samples(self) -> List[Sample]:
        """Samples with at least one sampled token (a sample of pure context trains nothing)."""
        for s in self.samples:
            s.check()
        return [s for s in self.samples if s.num_generated]
