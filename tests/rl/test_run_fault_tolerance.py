"""End-to-end runs with engine workers in local processes: a worker killed mid-run is replaced, the run
finishes, and every issued trajectory is trained at most once and accounted for exactly once."""
import collections
import time

import pytest

from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.driver import RLRun


def tiny_config(tmp_path, **overrides):
    data = {
        "seed": 0, "mode": "async", "output_dir": str(tmp_path), "max_minutes": 5, "max_steps": 4,
        "env": {"name": "calculator", "max_numbers": 4, "pareto_alpha": 1.0, "max_new_tokens": 4},
        "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
        "rollout": {"num_engines": 2, "max_batch": 4, "max_len": 128, "group_size": 2, "max_inflight_groups": 4,
                    "max_buffered": 8, "episode_threads": 16},
        "train": {"batch_size": 4, "max_staleness": 100, "optim": {"lr": 1e-4}},
        "eval": {"every": 0, "samples_per_problem": 1},
    }
    data.update(overrides)
    return config_from_dict(data)


def check_exactly_once(run):
    acc = run.accounting()
    trained = collections.Counter(acc["trained"])
    assert all(n == 1 for n in trained.values()), "a trajectory was trained twice"
    places = acc["trained"] + acc["dropped"] + acc["buffered"]
    assert collections.Counter(places) == collections.Counter(acc["issued"]), "a trajectory was lost or duplicated"


def test_killing_a_rollout_worker_mid_run(tmp_path):
    killed = {}

    def kill_then_await_replacement(step, run):
        if step == 2:
            killed["pid"] = run.executor.pid("engine0")
            run.executor.kill("engine0")
        if step == 4:  # training went on meanwhile; now the replacement must be up
            deadline = time.monotonic() + 180
            while run.replicas.replacements < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            killed["new_pid"] = run.executor.pid("engine0")

    run = RLRun(tiny_config(tmp_path, max_steps=6), hooks=[kill_then_await_replacement], log=lambda m: None)
    summary = run.run()
    assert summary["steps"] == 6
    assert summary["replacements"] >= 1 and killed["new_pid"] != killed["pid"]
    assert summary["catch_up_pushes"] >= 1  # the replacement got the newest weights before the ring took it back
    assert summary["producer_errors"] == [] and summary["failed_restarts"] == 0
    check_exactly_once(run)
    assert summary["trained_trajectories"] == 24


def test_sync_mode_trains_fresh_samples_only(tmp_path):
    run = RLRun(tiny_config(tmp_path, mode="sync", max_steps=2,
                            rollout={"num_engines": 1, "max_batch": 4, "max_len": 128, "group_size": 2}),
                log=lambda m: None)
    summary = run.run()
    assert summary["steps"] == 2 and summary["trained_trajectories"] == 8
    assert summary["staleness_histogram"] == {"0": 8}
    check_exactly_once(run)
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "reward_curve.png").exists()
    assert summary["metrics_skipped"] == []


def test_sync_mode_replaces_a_failed_group_without_training_leftovers_later(tmp_path):
    """A group whose environment crashes leaves the batch short: sync mode plays only the missing groups, so no
    surplus trajectory is left over to be trained one version stale at the next step."""
    run = RLRun(tiny_config(tmp_path, mode="sync", max_steps=2,
                            rollout={"num_engines": 1, "max_batch": 4, "max_len": 128, "group_size": 2}),
                log=lambda m: None)
    new_group = run.env.new_group

    def first_group_crashes(group_id, group_size):
        episodes = new_group(group_id, group_size)
        if group_id == "g0":
            for episode in episodes:
                episode.observe = lambda output_ids: (_ for _ in ()).throw(RuntimeError("sandbox died"))
        return episodes

    run.env.new_group = first_group_crashes
    summary = run.run()
    assert summary["steps"] == 2 and summary["env_failures"] == 2
    assert summary["staleness_histogram"] == {"0": 8}
    rows = [r for r in run.metrics.rows if "staleness_histogram" in r and "reward" in r]
    assert [r["staleness_histogram"] for r in rows] == [{"0": 4}, {"0": 4}]
    check_exactly_once(run)


def test_evaluation_frees_its_router_pins_and_cache_entries(tmp_path):
    run = RLRun(tiny_config(tmp_path, mode="sync", max_steps=1,
                            env={"name": "arithmetic", "max_operand": 2, "max_new_tokens": 1},
                            rollout={"num_engines": 2, "max_batch": 4, "max_len": 64, "group_size": 2}),
                log=lambda m: None)
    generate, rids = run.replicas.generate, []

    def recording_generate(trajectory_id, request):
        rids.append((trajectory_id, request.get("rid")))
        return generate(trajectory_id, request)

    run.replicas.generate = recording_generate
    run.replicas.start()
    try:
        for _ in range(2):
            assert run.evaluate() is not None
        assert rids and all(tid == rid for tid, rid in rids)  # the engine caches under the id that is ended
        assert sum(run.router.live_trajectories().values()) == 0
        infos = run.replicas.info().values()
        assert len(infos) == 2 and all(info["prefix_cache_entries"] == 0 for info in infos)
    finally:
        run.replicas.shutdown()


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        tiny_config(tmp_path, mode="fast")
    with pytest.raises(ValueError, match="batch_size"):
        tiny_config(tmp_path, train={"batch_size": 3})
    with pytest.raises(ValueError, match="rollout.engines: unknown key; did you mean 'num_engines'"):
        tiny_config(tmp_path, rollout={"engines": 2})
    with pytest.raises(ValueError, match="env.name"):
        tiny_config(tmp_path, env={"name": "chess"})
    for bad in ({"prefix_cache_entries": -1}, {"prefix_cache_tokens": 0}, {"prefix_cache_tokens": True}):
        with pytest.raises(ValueError, match=f"rollout.{next(iter(bad))}"):
            tiny_config(tmp_path, rollout=bad)


def test_the_prefix_cache_budget_reaches_the_workers_engines(tmp_path):
    from glm5_core.rl.serving.worker import build_server

    run = RLRun(tiny_config(tmp_path, rollout={"num_engines": 1, "group_size": 2, "prefix_cache_entries": 7,
                                               "prefix_cache_tokens": 300}), log=lambda m: None)
    server = build_server(run._spec("engine0"))
    cache = server.engine.prefix_cache
    assert (cache.max_entries, cache.max_tokens) == (7, 300)
