import pytest

from glm5_core.rl.fleet.router import ConsistentHashRouter, RoundRobinRouter

KEYS = [f"traj-{i}" for i in range(3000)]


def test_removing_a_replica_moves_only_its_keys():
    router = ConsistentHashRouter(["a", "b", "c", "d"])
    before = {k: router.home(k) for k in KEYS}
    router.remove_replica("c")
    after = {k: router.home(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == "c" for k in moved)
    assert all(after[k] != "c" for k in KEYS)


def test_adding_a_replica_moves_about_one_nth_and_spreads_evenly():
    router = ConsistentHashRouter(["a", "b", "c"])
    before = {k: router.home(k) for k in KEYS}
    router.add_replica("d")
    after = {k: router.home(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved)
    assert 0.15 < len(moved) / len(KEYS) < 0.35  # ~1/4 with 150 virtual nodes
    share = sum(after[k] == "d" for k in KEYS) / len(KEYS)
    assert 0.15 < share < 0.35


def test_unhealthy_replica_is_skipped_and_comes_back():
    router = ConsistentHashRouter(["a", "b"])
    key = next(k for k in KEYS if router.home(k) == "a")
    router.mark_unhealthy("a")
    assert router.acquire(key) == "b"
    router.release(key, "b")
    router.forget(key)
    router.mark_healthy("a")
    assert router.acquire(key) == "a"


def test_requests_of_one_trajectory_stay_on_one_replica():
    router = ConsistentHashRouter(["a", "b", "c"])
    for k in KEYS[:50]:
        first = router.acquire(k)
        router.release(k, first)
        for _ in range(5):
            name = router.acquire(k)
            router.release(k, name)
            assert name == first


def test_light_rebalancing_bounds_the_load_of_new_keys():
    router = ConsistentHashRouter(["a", "b"], imbalance_factor=1.25)
    held = [(k, router.acquire(k)) for k in KEYS[:400]]  # all in flight at once
    load = router.load()
    mean = sum(load.values()) / 2
    assert max(load.values()) <= 1.25 * mean + 1
    for k, name in held:
        router.release(k, name)
    assert router.load() == {"a": 0, "b": 0}


def test_bad_arguments():
    with pytest.raises(ValueError, match="virtual_nodes"):
        ConsistentHashRouter(virtual_nodes=0)
    with pytest.raises(ValueError, match="imbalance_factor"):
        ConsistentHashRouter(imbalance_factor=0.5)
    with pytest.raises(ValueError, match="unknown replica"):
        ConsistentHashRouter(["a"]).remove_replica("b")
    with pytest.raises(RuntimeError, match="no healthy"):
        ConsistentHashRouter().acquire("x")


def test_round_robin_alternates_whatever_the_key():
    rr = RoundRobinRouter(["a", "b"])
    assert [rr.acquire("same") for _ in range(4)] == ["a", "b", "a", "b"]


def test_live_trajectories_between_turns_count_for_rebalancing():
    """A trajectory waiting on its environment has no request in flight, but its cache entry still lives on
    its replica: new keys must be balanced against live trajectories, not requests in flight."""
    router = ConsistentHashRouter(["a", "b"], imbalance_factor=1.0)
    keys = [k for k in KEYS if router.home(k) == "a"][:10]
    for k in keys:  # one request each, released before the next trajectory starts
        router.release(k, router.acquire(k))
    live = router.live_trajectories()
    assert live == {"a": 5, "b": 5} and router.load() == {"a": 0, "b": 0}
    for k in keys:  # pinned: later turns stay where their cache is
        name = router.acquire(k)
        router.release(k, name)
        assert router.live_trajectories()[name] == 5
    for k in keys:
        router.forget(k)
    assert router.live_trajectories() == {"a": 0, "b": 0}
    assert router.acquire(keys[0]) == "a"  # nothing live: the key goes home again


@pytest.mark.parametrize("make", [lambda: RoundRobinRouter(["a", "b"]), lambda: ConsistentHashRouter(["a", "b"])])
def test_mark_unhealthy_twice_is_harmless(make):
    """Two in-flight requests on one dead replica both report it (or a request and the supervisor do)."""
    router = make()
    router.mark_unhealthy("a")
    router.mark_unhealthy("a")
    assert router.healthy_replicas() == ["b"]
    assert {router.acquire(f"k{i}") for i in range(6)} == {"b"}
    router.mark_healthy("a")
    router.mark_healthy("a")
    assert sorted(router.healthy_replicas()) == ["a", "b"]
