"""Routing / index replay end to end: the engine records every position's experts and DSA keys, the response
carries them in SGLang 0.5.23's wire form (base64 int32 over all hidden layers), the TITO gateway checks and keeps
them on the sample, and the trainer's forward uses bitwise those experts and keys, also after the trainer's weights
moved on (async staleness)."""
import json

import pytest
import torch

from glm5_core.rl.algorithm.replay_batch import pad_traces
from glm5_core.rl.algorithm.trainer import PolicyTrainer, TrainerConfig, pad_samples, sequence_logprobs
from glm5_core.rl.rollout.gateway import TITOGateway
from glm5_core.rl.rollout.trajectory import Trajectory
from glm5_core.rl.serving import replay_trace
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import Limits, parse_generate_request
from glm5_core.rl.serving.replay_trace import TraceLayout

LIMITS = Limits(vocab_size=264, max_input_tokens=127, max_new_tokens=64)


def engine_fn(engine):
    """generate_fn of a gateway: the request and the response go through JSON, as over HTTP."""
    def generate(trajectory_id, body):
        request = parse_generate_request(json.loads(json.dumps(body)), LIMITS)
        result = engine.generate([request])[0]
        layout = TraceLayout.of(engine.model.config)
        return json.loads(json.dumps(result.to_json(request.return_logprob, layout=layout)))
    return generate


def play(engine, n=3, turns=2):
    """n two-turn trajectories through gateways that ask for both traces."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        gateway = TITOGateway(f"t{i}", engine_fn(engine), return_routed_experts=True, return_indexer_topk=True)
        context = torch.randint(0, 256, (12 + 5 * i,), generator=g).tolist()
        for _ in range(turns):
            response = gateway.generate(context, {"temperature": 1.0, "max_new_tokens": 10})
            context = context + response["output_ids"] + [40, 41, 42]  # environment tokens, then the next turn
        samples += gateway.finished_samples()
    return samples


@pytest.fixture()
def engine(tiny_policy):
    return RolloutEngine(tiny_policy, max_batch=2, max_len=128, seed=3, record_routing=True, record_index_topk=True)


def replay_args(model, samples):
    cfg = model.config
    layout = TraceLayout.of(cfg)
    routing, _ = pad_traces(samples, "routing", layout, cfg.num_experts_per_tok)
    index, _ = pad_traces(samples, "index", layout, cfg.index_topk)
    return routing, index


def test_trainer_forward_uses_the_rollout_experts_and_keys(tiny_policy, engine):
    samples = play(engine)
    assert engine.stats.cached_tokens > 0  # second turns reused the prefix cache: their traces came from it
    routing, index = replay_args(tiny_policy, samples)
    ids = pad_samples(samples)["input_ids"]
    with torch.no_grad():
        out = tiny_policy(ids, routing_replay=routing, index_replay=index)
    cfg = tiny_policy.config
    L, K, Ki = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.index_topk
    kinds = cfg.layer_indexer_types()
    assert cfg.first_k_dense_replace >= 1 and "shared" in kinds  # the layouts below are exercised
    for row, s in enumerate(samples):
        n = len(s.tokens) - 1
        # SGLang's arrays: int32 over every hidden layer
        experts = s.routed_experts.reshape(n, L, K)
        keys = s.indexer_topk.reshape(n, L, Ki)
        assert s.routed_experts.dtype == torch.int32 and s.indexer_topk.dtype == torch.int32
        assert not experts[:, :cfg.first_k_dense_replace].any()  # dense layers: zero rows, as SGLang leaves them
        moe = [i for i in range(L) if cfg.is_moe_layer(i)]
        full = [i for i, kind in enumerate(kinds) if kind == "full"]
        assert torch.equal(torch.stack(out.expert_ids, 2)[row, :n], experts[:, moe])
        assert torch.equal(torch.stack(out.topk_idx, 2)[row, :n], keys[:, full])
        for i, kind in enumerate(kinds):  # a shared layer's row repeats the last full layer's keys
            if kind == "shared":
                assert torch.equal(keys[:, i], keys[:, max(f for f in full if f < i)])


def test_at_equal_weights_the_trainer_already_agrees(tiny_policy, engine):
    """The recording is what the trainer's own forward computes (so replay at equal weights changes nothing)."""
    samples = play(engine)
    ids = pad_samples(samples)["input_ids"]
    with torch.no_grad():
        out = tiny_policy(ids)
    routing, index = replay_args(tiny_policy, samples)  # the recorded traces, picked out of SGLang's arrays
    for row, s in enumerate(samples):
        n = len(s.tokens) - 1
        assert torch.equal(torch.stack(out.expert_ids, 2)[row, :n], routing[row, :n].to(torch.int32))
        assert torch.equal(torch.stack(out.topk_idx, 2)[row, :n], index[row, :n].to(torch.int32))


def test_replay_holds_after_the_weights_moved(tiny_policy, engine):
    samples = play(engine)
    stale = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    try:
        with torch.no_grad():  # the trainer's policy moved on: routers and indexers see other scores now
            for p in tiny_policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        routing, index = replay_args(tiny_policy, samples)
        ids = pad_samples(samples)["input_ids"]
        with torch.no_grad():
            free = tiny_policy(ids)
            replayed = tiny_policy(ids, routing_replay=routing, index_replay=index)
        rows = [(row, len(s.tokens) - 1) for row, s in enumerate(samples)]
        free_experts, used_experts = torch.stack(free.expert_ids, 2), torch.stack(replayed.expert_ids, 2)
        free_keys, used_keys = torch.stack(free.topk_idx, 2), torch.stack(replayed.topk_idx, 2)
        assert any(not torch.equal(free_experts[r, :n], routing[r, :n].int()) for r, n in rows)  # it matters
        assert any(not torch.equal(free_keys[r, :n], index[r, :n].int()) for r, n in rows)
        for r, n in rows:
            assert torch.equal(used_experts[r, :n], routing[r, :n].int())
            assert torch.equal(used_keys[r, :n], index[r, :n].int())
    finally:
        tiny_policy.load_state_dict(stale)


def test_trainer_step_with_replay_trains_the_router(tiny_policy, engine):
    samples = play(engine, n=2, turns=1)
    before = {k: v.clone() for k, v in tiny_policy.state_dict().items()}
    try:
        trainer = PolicyTrainer(tiny_policy, TrainerConfig(lr=1e-2), temperature=1.0, routing_replay=True,
                          index_replay=True)
        stats = trainer.train_step([Trajectory(f"t{i}", "g", [s], reward=float(i)) for i, s in enumerate(samples)])
        assert stats["routing_replay_untraced_samples"] == 0 and stats["index_replay_untraced_samples"] == 0
        router = "model.layers.1.mlp.gate.weight"
        assert not torch.equal(tiny_policy.state_dict()[router], before[router])
    finally:
        tiny_policy.load_state_dict(before)


def test_sequence_logprobs_with_replay_at_equal_weights_match_without(tiny_policy, engine):
    samples = play(engine, n=2)
    routing, index = replay_args(tiny_policy, samples)
    ids = pad_samples(samples)["input_ids"]
    with torch.no_grad():
        plain, _ = sequence_logprobs(tiny_policy, ids, 1.0)
        replayed, _ = sequence_logprobs(tiny_policy, ids, 1.0, routing_replay=routing, index_replay=index)
    assert torch.equal(plain, replayed)


def test_a_trace_of_the_wrong_shape_is_refused(tiny_policy, engine):
    samples = play(engine, n=1, turns=1)
    layout, K = TraceLayout.of(tiny_policy.config), tiny_policy.config.num_experts_per_tok
    whole = samples[0].routed_experts
    samples[0].routed_experts = whole[:-1]  # a position short
    with pytest.raises(ValueError, match="routed_experts"):
        pad_traces(samples, "routing", layout, K)
    samples[0].routed_experts = whole[:, :-K]  # a layer short
    with pytest.raises(ValueError, match="routed_experts"):
        pad_traces(samples, "routing", layout, K)


def test_engine_without_recording_refuses_the_request(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=1, max_len=64)
    request = parse_generate_request({"input_ids": [1, 2, 3], "return_routed_experts": True}, LIMITS)
    with pytest.raises(ValueError, match="return_routed_experts"):
        engine.submit(request)


def test_replay_flags_must_be_bools():
    with pytest.raises(ValueError, match="return_indexer_topk"):
        parse_generate_request({"input_ids": [1], "return_indexer_topk": 1}, LIMITS)


LAYOUT = TraceLayout(num_layers=3, moe_layers=(1, 2), full_index_layers=(0, 2), index_sources=(0, 0, 1))


@pytest.mark.parametrize("edit, match", [
    (lambda w: {"dtype": "int32", "data": w}, "base64 string"),  # glm5-core's old object form
    (lambda w: w[:-4], "whole int32 rows"),
    (lambda w: w[:-1], "base64 of at most"),
    (lambda w: "!" * len(w), "base64"),
    (lambda w: "A" * (4 * (256 << 20) // 3 + 8), "at most"),
])
def test_wire_traces_are_checked(edit, match):
    trace = torch.randint(0, 8, (4, 2, 2), dtype=torch.uint8)  # [P, M, K]
    decoded = replay_trace.decode(replay_trace.encode(trace, "routing", LAYOUT), "meta_info.routed_experts", rows=4)
    assert decoded.shape == (4, 3 * 2) and decoded.dtype == torch.int32
    assert torch.equal(replay_trace.select(decoded, "x", wire_layers=3, layers=(1, 2), width=2), trace.int())
    assert not decoded.reshape(4, 3, 2)[:, 0].any()  # the dense layer's row
    with pytest.raises(ValueError, match=match):
        replay_trace.decode(edit(replay_trace.encode(trace, "routing", LAYOUT)), "meta_info.routed_experts", rows=4)


def test_int16_keys_round_trip_with_padding_and_shared_layers_mirror_their_full_layer():
    keys = torch.tensor([[[0, -1, -1], [0, -1, -1]], [[1, 0, -1], [0, 1, -1]]], dtype=torch.int16)  # [P, F, Ki]
    decoded = replay_trace.decode(replay_trace.encode(keys, "index", LAYOUT), "k", rows=2).reshape(2, 3, 3)
    assert torch.equal(decoded[:, [0, 2]], keys.int()) and torch.equal(decoded[:, 1], decoded[:, 0])


def test_the_wire_form_is_sglangs_base64_int32():
    """What slime does with SGLang's answer (``np.frombuffer(base64.b64decode(s), dtype=np.int32)``, then a
    reshape to (seqlen - 1, num_layers, topk)) reads our engine's traces."""
    import base64

    import numpy as np

    trace = torch.randint(0, 8, (5, 2, 2), dtype=torch.uint8)
    wire = replay_trace.encode(trace, "routing", LAYOUT)
    array = np.frombuffer(base64.b64decode(wire.encode("utf-8")), dtype=np.int32).reshape(5, 3, 2)
    assert (array[:, 1:] == trace.numpy()).all() and (array[:, 0] == 0).all()


def test_config_keys(monkeypatch):
    from glm5_core.rl.config_loader import config_from_dict

    monkeypatch.setenv("GLM5_MEMORY_BYTES", str(16 << 30))
    cfg = config_from_dict({"train": {"routing_replay": True, "index_replay": True}})
    assert cfg.train.routing_replay and cfg.train.index_replay
    with pytest.raises(ValueError, match="train.routing_replay"):
        config_from_dict({"train": {"routing_replay": "yes"}})
    # external engines send SGLang's wire form, which the gateway reads: replay works with them too
    cfg = config_from_dict({"train": {"routing_replay": True}, "rollout": {"engine_urls": ["http://127.0.0.1:30000"]}})
    assert cfg.train.routing_replay
