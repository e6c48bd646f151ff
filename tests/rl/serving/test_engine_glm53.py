"""The rollout engine on a GLM-5.3-style model (KDA + indexed layers, mHC): KDA layers decode from their
recurrent + conv state kept per slot, so the engine's log-probs equal the trainer's recomputation (fp32, 1e-5)
and its k-pool top-k traces equal the trainer's selections; the paths a recurrent state rules out are refused
(speculative decoding) or turned off (prefix reuse) in one line."""
import pytest
import torch

from glm5_core.model import GLM5Config, GLM5ForCausalLM
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest
from tests.rl.serving.test_engine_consistency import make_requests, recompute


@pytest.fixture(scope="module")
def glm53_policy():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(GLM5Config.tiny_glm53(hidden_size=64, index_topk=8, index_n_heads=8),
                            backend="cpu").eval()
    model.reset_parameters(seed=0)
    return model


def test_engine_logprobs_and_topk_match_the_trainer(glm53_policy):
    engine = RolloutEngine(glm53_policy, max_batch=3, max_len=64, record_topk=True, seed=1)
    requests = make_requests(5, prompt_len=9, max_new=8)  # 5 requests of 9..21 tokens, 3 slots, past index_topk
    results = engine.generate(requests)
    batch, logp, topk = recompute(glm53_policy, requests, results, 1.0)
    assert engine.stats.decode_slot_steps > engine.stats.decode_steps  # several slots decoded together
    worst, compared = 0.0, 0
    for row, (req, res) in enumerate(zip(requests, results)):
        P = len(req.input_ids)
        got = logp[row, P - 1:P - 1 + len(res.output_ids)]
        worst = max(worst, (got - torch.tensor(res.logprobs)).abs().max().item())
        for j in range(len(res.output_ids)):
            for layer, idx in enumerate(topk):
                assert sorted(idx[row, P - 1 + j].tolist()) == sorted(res.topk_trace[j][layer]), (row, j)
                compared += 1
    assert worst <= 1e-5 and compared >= 40
    assert topk[0].shape[-1] == 8 + 4 - 1  # index_topk + the tail group


def test_paths_a_recurrent_state_rules_out(glm53_policy):
    with pytest.raises(ValueError, match=r"^speculative: expected none for a model with KDA layers"):
        RolloutEngine(glm53_policy, max_batch=2, max_len=64, speculative={"draft_tokens": 2})
    with pytest.raises(ValueError, match=r"^record_index_topk: expected False for a model with KDA layers"):
        RolloutEngine(glm53_policy, max_batch=2, max_len=64, record_index_topk=True)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^index_replay: expected None for a glm5_next model"):
        glm53_policy(ids, index_replay=torch.full((1, 4, 2, 11), -1, dtype=torch.int32))
    engine = RolloutEngine(glm53_policy, max_batch=2, max_len=64, seed=0)
    (req,) = make_requests(1, prompt_len=12, max_new=3, prefix="p")
    (res,) = engine.generate([req])
    follow = GenerateRequest(req.rid, req.input_ids + res.output_ids + [40], max_new_tokens=2)
    (res2,) = engine.generate([follow])
    assert res2.cached_tokens == 0  # no prefix reuse: the whole conversation is prefilled again


def test_routing_replay_is_recorded_and_replays(glm53_policy):
    """Routing replay (R3) on a GLM-5.3 model: the engine records each position's experts, and a forward that
    replays them gives the engine's log-probs."""
    from glm5_core.rl.serving import replay_trace

    engine = RolloutEngine(glm53_policy, max_batch=2, max_len=64, seed=3, record_routing=True)
    (req,) = make_requests(1, prompt_len=10, max_new=5, prefix="rr")
    req.return_routed_experts = True
    (res,) = engine.generate([req])
    seq = req.input_ids + res.output_ids
    P = len(seq) - 1
    layout = replay_trace.TraceLayout.of(glm53_policy.config)  # through SGLang's wire form, as over HTTP
    wire = replay_trace.decode(replay_trace.encode(res.routed_experts, "routing", layout), "routed_experts", rows=P)
    wire_layers, rows = layout.wire("routing")
    routed = replay_trace.select(wire, "routed_experts", wire_layers=wire_layers, layers=rows,
                                 width=glm53_policy.config.num_experts_per_tok)  # [P, M, K]
    ids = torch.tensor([seq[:-1]])
    with torch.no_grad():
        logits = glm53_policy(ids, routing_replay=routed.unsqueeze(0).to(torch.int32)).logits
    logp = torch.log_softmax(logits[0], -1)[torch.arange(P), torch.tensor(seq[1:])]
    got = logp[len(req.input_ids) - 1:]
    assert (got - torch.tensor(res.logprobs)).abs().max() <= 1e-5
