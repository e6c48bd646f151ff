"""The rollout engine's speed paths compute what the plain paths compute: kept stacked expert weights never
outlive a weight push, decoding over slot windows / concurrent slot groups gives the tokens of one full-batch
forward, and the cache windows are views of the engine's cache."""
import copy
import dataclasses

import pytest
import torch

from glm5_core.model.moe import MoE
from glm5_core.rl.serving import kv_slots
from glm5_core.rl.serving.decode_threads import DecodeThreads, split_groups
from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.protocol import GenerateRequest


def _requests(n, prompt_len=11, max_new=8, temperature=0.0, prefix="f", vocab=256):
    g = torch.Generator().manual_seed(prompt_len + n)
    return [GenerateRequest(f"{prefix}{i}", torch.randint(0, vocab, (prompt_len + 2 * i,), generator=g).tolist(),
                            temperature=temperature, max_new_tokens=max_new + 3 * (i % 2)) for i in range(n)]


def _generate(model, requests, **engine_kwargs):
    engine = RolloutEngine(model, max_batch=4, max_len=96, seed=1, **engine_kwargs)
    return [(r.output_ids, r.logprobs) for r in engine.generate(requests)], engine


@torch.no_grad()
def _expert_weights_scaled(model, factor):
    """A state dict of ``model`` whose routed expert weights (only) are multiplied by ``factor``."""
    return {name: (t * factor if ".experts." in name else t.clone()) for name, t in model.state_dict().items()}


def test_engine_keeps_stacked_expert_weights_by_default(tiny_policy):
    model = copy.deepcopy(tiny_policy)
    _generate(model, _requests(1))
    main_moe = [layer.mlp for layer in model.model.main_layers() if isinstance(layer.mlp, MoE)]  # the MTP's idles
    assert main_moe and all(layer.reuse_stacked_weights and layer._stacked_cache for layer in main_moe)
    opted_out = copy.deepcopy(tiny_policy).reuse_stacked_expert_weights(False)
    _generate(opted_out, _requests(1), reuse_stacked_weights=False)  # opting out stays possible
    assert not any(layer.reuse_stacked_weights or layer._stacked_cache for layer in opted_out.moe_layers())


@pytest.mark.parametrize("threaded", [False, True], ids=["caller_applies", "scheduler_applies"])
@pytest.mark.parametrize("partial", [False, True])
def test_weight_push_replaces_kept_stacked_expert_weights(tiny_policy, partial, threaded):
    """After a push that changes only the routed experts, the engine decodes with the new experts: its tokens
    and log-probs are those of an engine built on the new weights (a stale stacked copy would give the old).
    With a scheduler thread the push lands inside a step (inference mode), without one in the caller."""
    model = copy.deepcopy(tiny_policy)
    engine = RolloutEngine(model, max_batch=4, max_len=96, seed=1)
    if threaded:
        engine.start()
    requests = _requests(3)
    before = [(r.output_ids, r.logprobs) for r in engine.generate(requests)]  # fills the kept stacks
    new_state = _expert_weights_scaled(model, 1.7)
    push = {k: v for k, v in new_state.items() if ".experts." in k} if partial else new_state
    engine.update_weights(push, version=1, partial=partial, wait=60 if threaded else None)
    for r in requests:
        engine.end_trajectory(r.rid)
    after = [(r.output_ids, r.logprobs) for r in engine.generate(requests)]
    engine.shutdown()

    reference = copy.deepcopy(tiny_policy)
    reference.load_state_dict(new_state)
    want, _ = _generate(reference, requests, reuse_stacked_weights=False)
    assert after == want
    assert after != before  # the push mattered: serving the old stacks would have been caught


def test_drop_stacked_expert_weights_after_a_write_through_data(tiny_policy):
    """A write through ``param.data`` bumps no version counter: the kept stacks go stale until
    ``drop_stacked_expert_weights`` (what every engine push calls)."""
    model = copy.deepcopy(tiny_policy).reuse_stacked_expert_weights(True)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        old = model(ids).logits
        for layer in model.moe_layers():
            for expert in layer.experts:
                expert.down_proj.weight.data.mul_(3.0)
        assert torch.equal(model(ids).logits, old)  # stale, as documented
        model.drop_stacked_expert_weights()
        fresh = copy.deepcopy(model).reuse_stacked_expert_weights(False)
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, atol=0, rtol=0)
        assert not torch.equal(fresh(ids).logits, old)


def test_decode_threads_and_slot_windows_give_one_batch_tokens(tiny_policy):
    """Requests of different lengths finish at different steps (holes in the slots, filled by waiting
    requests): the greedy tokens are those of each request decoded alone, whether one thread decodes the
    active slots' window or two threads decode two groups; the log-probs agree to rounding."""
    requests = _requests(6, max_new=6)
    alone = [_generate(tiny_policy, [r])[0][0] for r in requests]
    for threads in (1, 2, 3):
        got, engine = _generate(tiny_policy, requests, decode_threads=threads)
        engine.shutdown()
        assert [ids for ids, _ in got] == [ids for ids, _ in alone]
        for (_, lp), (_, lp_alone) in zip(got, alone):
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_alone), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_engine_rejects_bad_decode_threads(tiny_policy, bad):
    with pytest.raises(ValueError, match="decode_threads"):
        RolloutEngine(tiny_policy, decode_threads=bad)


def test_split_groups_is_contiguous_balanced_and_complete():
    assert split_groups([0, 1, 2, 5, 6], 2) == [[0, 1], [2, 5, 6]]
    assert split_groups([3], 4) == [[3]]
    assert split_groups([0, 1, 2, 3], 1) == [[0, 1, 2, 3]]
    groups = split_groups(list(range(11)), 3)
    assert sum(groups, []) == list(range(11)) and max(map(len, groups)) - min(map(len, groups)) <= 1


def test_decode_threads_map_runs_groups_in_inference_mode_and_restores_the_callers_threads():
    decoders = DecodeThreads(2, intra_op_threads=1)
    before = torch.get_num_threads()
    try:
        seen = decoders.map(lambda g: (g, torch.is_inference_mode_enabled(), torch.get_num_threads()), [[0], [1, 2]])
    finally:
        decoders.close()
    assert [s[0] for s in seen] == [[0], [1, 2]]
    assert all(inference and threads == 1 for _, inference, threads in seen)
    assert torch.get_num_threads() == before and not torch.is_inference_mode_enabled()
    def fails_on_the_pool(group):
        if group == [1]:
            raise RuntimeError("boom")
        return group

    decoders = DecodeThreads(2, None)
    with pytest.raises(RuntimeError, match="boom"):
        decoders.map(fails_on_the_pool, [[0], [1]])
    decoders.close()


def test_row_window_is_a_view_of_the_cache_rows(tiny_policy):
    cache = tiny_policy.new_cache(5, 16)
    window = kv_slots.row_window(cache, 1, 3)
    assert window.batch_size == 2 and window.max_len == 16
    for store, view in zip(kv_slots.tensors(cache), kv_slots.tensors(window)):
        view.fill_(7.0)
        assert bool((store[1:3] == 7.0).all()) and not bool((store[0] == 7.0).any())
        assert not bool((store[3:] == 7.0).any())


def test_a_decode_over_every_slot_uses_the_cache_itself(tiny_policy, monkeypatch):
    """Every slot active (batch = max_batch): the decode step forwards over the engine's cache, not a window of
    views built per step; the tokens and log-probs are those of the windowed path (a fifth, idle slot)."""
    model = copy.deepcopy(tiny_policy)
    requests = [dataclasses.replace(r, max_new_tokens=3) for r in _requests(4)]
    windows = []
    real = kv_slots.row_window
    monkeypatch.setattr(kv_slots, "row_window", lambda cache, lo, hi: windows.append((lo, hi)) or real(cache, lo, hi))

    def run(max_batch):
        engine = RolloutEngine(model, max_batch=max_batch, max_len=96, seed=1)
        return [(r.output_ids, r.logprobs) for r in engine.generate(requests)]

    want = run(5)
    assert (0, 4) in windows  # slots 0..3 of 5: a window
    windows.clear()
    assert run(4) == want and (0, 4) not in windows
