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
    engine = RolloutEngine(glm53_policy, max_batch=2, max_len=64, seed=0)
    (req,) = make_requests(1, prompt_len=12, max_new=3, prefix="p")
    (res,) = engine.generate([req])
    follow = GenerateRequest(req.rid, req.input_ids + res.output_ids + [40], max_new_tokens=2)
    (res2,) = engine.generate([follow])
    assert res2.cached_tokens == 0  # no prefix reuse: the whole conversation is prefilled again
