"""TrajectoryPrefixCache budgets (entries, cached positions) and how the engine moves entries in and out."""
import pytest
import torch

from glm5_core.rl.serving.engine import RolloutEngine
from glm5_core.rl.serving.prefix_cache import TrajectoryPrefixCache
from glm5_core.rl.serving.protocol import GenerateRequest


def kv(n):
    """One fake cache field: [1, n, 2], position i holds the value i."""
    return [torch.arange(n, dtype=torch.float32).repeat_interleave(2).view(1, n, 2)]


def store(cache, key, n, first=0):
    cache.store(key, list(range(first, first + n)), kv(n))


def test_entry_budget_evicts_least_recently_used():
    cache = TrajectoryPrefixCache(2)
    store(cache, "a", 3)
    store(cache, "b", 3)
    assert cache.lookup("a", [0, 1, 2, 9])[0] == 3  # touches "a": "b" is now the oldest
    store(cache, "c", 3)
    assert cache.lookup("b", [0, 1, 2, 9]) == (0, None)
    assert cache.lookup("a", [0, 1, 2, 9])[0] == 3 and cache.lookup("c", [0, 1, 2, 9])[0] == 3
    assert cache.evictions == 1


def test_token_budget_counts_positions_and_evicts_until_it_holds():
    cache = TrajectoryPrefixCache(100, max_tokens=10)
    store(cache, "a", 4)
    store(cache, "b", 5)
    assert cache.num_tokens == 9
    store(cache, "a", 6)  # replaces a's entry: 6 + 5 > 10, so the oldest other entry ("b") goes
    assert cache.num_tokens == 6 and len(cache) == 1
    assert cache.lookup("a", list(range(7)))[0] == 6
    store(cache, "c", 3)
    store(cache, "d", 2)  # 6 + 3 + 2 = 11 > 10: "a" (least recently used) is evicted, c and d stay
    assert cache.num_tokens == 5 and cache.lookup("a", [0, 1]) == (0, None)
    assert cache.evictions == 2


def test_entry_longer_than_the_token_budget_is_not_kept_and_replaces_the_old_one():
    cache = TrajectoryPrefixCache(4, max_tokens=8)
    store(cache, "a", 5)
    store(cache, "b", 2)
    store(cache, "a", 9)
    assert cache.lookup("a", list(range(10))) == (0, None)  # neither the new nor the outdated entry
    assert cache.num_tokens == 2 and cache.lookup("b", [0, 1, 5])[0] == 2


def test_lookup_reuses_the_common_prefix_but_never_the_last_input_token():
    cache = TrajectoryPrefixCache(4)
    store(cache, "a", 6)
    assert cache.lookup("a", [0, 1, 2, 7, 8])[0] == 3  # diverges at position 3
    assert cache.lookup("a", [0, 1, 2])[0] == 2  # the last input token is recomputed
    n, entry = cache.lookup("a", list(range(10)))
    assert n == 6 and entry.tokens == list(range(6))
    assert cache.lookup("a", [5, 1, 2]) == (0, None)


def test_drop_and_flush_release_their_tokens():
    cache = TrajectoryPrefixCache(4, max_tokens=100)
    store(cache, "a", 5)
    store(cache, "b", 7)
    cache.drop("a")
    cache.drop("missing")
    assert cache.num_tokens == 7 and len(cache) == 1
    cache.flush()
    assert cache.num_tokens == 0 and len(cache) == 0


def test_zero_entries_disables_the_cache():
    cache = TrajectoryPrefixCache(0)
    store(cache, "a", 3)
    assert len(cache) == 0 and cache.lookup("a", [0, 1, 2, 3]) == (0, None)


def test_bad_budgets():
    with pytest.raises(ValueError, match="prefix_cache_entries"):
        TrajectoryPrefixCache(-1)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        TrajectoryPrefixCache(4, max_tokens=-3)
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        TrajectoryPrefixCache(4, max_tokens=2.5)


def prompt(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_running_request_takes_its_entry_out_and_stores_it_back_extended(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=128, seed=0)
    first = GenerateRequest("t", prompt(12, 1), max_new_tokens=4)
    (res,) = engine.generate([first])
    stored = len(first.input_ids) + len(res.output_ids) - 1  # the last sampled token has no KV yet
    assert engine.prefix_cache.num_tokens == stored
    follow = GenerateRequest("t", first.input_ids + res.output_ids + [40, 41], max_new_tokens=3)
    engine.submit(follow)
    engine.step()  # admitted: the entry's KV now lives in the slot
    assert len(engine.prefix_cache) == 0 and engine.num_active() == 1
    engine.run_until_idle()
    assert engine.stats.cached_tokens == stored
    n, entry = engine.prefix_cache.lookup("t", follow.input_ids + [999])
    assert n == len(follow.input_ids) and entry.tokens[:n] == follow.input_ids
    assert engine.prefix_cache.num_tokens == len(entry.tokens) > len(follow.input_ids)
    engine.end_trajectory("t")
    assert len(engine.prefix_cache) == 0 and engine.prefix_cache.num_tokens == 0


def test_one_by_one_prefill_fallback_still_reuses_the_cached_prefix(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=64, seed=0)
    (res,) = engine.generate([GenerateRequest("long", prompt(40, 2), max_new_tokens=3)])
    stored = 40 + len(res.output_ids) - 1
    follow = GenerateRequest("long", prompt(40, 2) + res.output_ids + [7], max_new_tokens=1)
    fresh = GenerateRequest("fresh", prompt(30, 3), max_new_tokens=1)  # stored + 30 new > max_len: one by one
    results = engine.generate([follow, fresh])
    assert [r.cached_tokens for r in results] == [stored, 0]
    # the cached continuation is what a full prefill computes: same greedy token either way
    greedy = GenerateRequest("long", follow.input_ids, temperature=0.0, max_new_tokens=1)
    with_cache = engine.generate([greedy])[0]
    fresh_engine = RolloutEngine(tiny_policy, max_batch=1, max_len=64, seed=0)
    without = fresh_engine.generate([GenerateRequest("other", follow.input_ids, temperature=0.0, max_new_tokens=1)])[0]
    assert with_cache.cached_tokens > 0 and with_cache.output_ids == without.output_ids


def test_engine_token_budget_bounds_the_cache(tiny_policy):
    engine = RolloutEngine(tiny_policy, max_batch=2, max_len=128, seed=0, prefix_cache_tokens=30)
    engine.generate([GenerateRequest("a", prompt(20, 4), max_new_tokens=3)])
    engine.generate([GenerateRequest("b", prompt(20, 5), max_new_tokens=3)])
    assert len(engine.prefix_cache) == 1 and engine.prefix_cache.num_tokens <= 30
    assert engine.prefix_cache.lookup("a", prompt(20, 4) + [1]) == (0, None)
    assert engine.prefix_cache.lookup("b", prompt(20, 5) + [1])[0] == 20
