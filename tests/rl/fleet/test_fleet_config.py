"""Placement of trainer and engines, the fleet keys of the RL config, SGLang weight versions in the gateway,
and the starving-trainer guard."""
import tracemalloc

import pytest

from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.fleet.placement import (
    check_engine_devices,
    check_visible,
    engine_devices,
    in_worker_device,
    parse_devices,
    ray_resources,
    worker_environment,
)
from glm5_core.rl.rollout.gateway import parse_weight_version, token_versions


def test_devices_map_to_one_visible_accelerator_per_worker():
    assert parse_devices("cuda:1, cuda:2", "rollout.devices") == ["cuda:1", "cuda:2"]
    assert engine_devices("cuda:1,cuda:2", 2) == ["cuda:1", "cuda:2"]
    assert engine_devices(["npu:3"], 3) == ["npu:3"] * 3  # one entry for all engines
    assert engine_devices(None, 2) == [None, None]
    assert worker_environment("cuda:2") == {"CUDA_VISIBLE_DEVICES": "2"} and in_worker_device("cuda:2") == "cuda:0"
    assert worker_environment("npu:1") == {"ASCEND_RT_VISIBLE_DEVICES": "1"} and in_worker_device("npu:1") == "npu:0"
    assert worker_environment("cpu") == {} and worker_environment(None) == {}
    assert ray_resources("cuda:5") == {"num_gpus": 1} and ray_resources("npu:0") == {"resources": {"NPU": 1}}
    assert ray_resources("cpu") == {} and ray_resources(None) == {}


@pytest.mark.parametrize("value,match", [
    ("gpu:0", "rollout.devices"), ("cuda", "index"), (["cuda:0", 3], r"rollout.devices\[1\]"), ("", "rollout.devices"),
])
def test_bad_devices_name_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        engine_devices(value, 1)


def test_devices_the_probe_does_not_see_are_refused_naming_the_key():
    probe = lambda: {"cuda": 2, "npu": 0}  # noqa: E731
    check_visible(["cuda:0", "cuda:1", "cpu"], "rollout.devices", probe)
    with pytest.raises(ValueError, match=r"rollout.devices: cuda:2 is not visible.*sees 2 cuda devices"):
        check_visible(["cuda:1", "cuda:2"], "rollout.devices", probe)
    with pytest.raises(ValueError, match="train.device: npu:0 is not visible.*0 npu"):
        check_visible(["npu:0"], "train.device", probe)
    with pytest.raises(ValueError, match="one device per engine"):
        engine_devices("cuda:0,cuda:1,cuda:2", 2)
    with pytest.raises(ValueError, match=r"one device per engine \(rollout.num_engines=2\)"):
        check_engine_devices("cuda:0,cuda:1,cuda:2", 2)


def test_checking_the_devices_builds_nothing_per_engine():
    check_engine_devices(None, 10 ** 15)  # a list of 10**15 entries would not fit anywhere
    check_engine_devices("cuda:0", 10 ** 15)


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_checking_a_config_allocates_nothing_of_num_engines_size(executor):
    """The config check once listed one device per engine: a fuzzed rollout.num_engines of 3e9 held 24 GB before
    the memory check (which counts engines without allocating them) could refuse it."""
    def peak_bytes(num_engines):
        tracemalloc.start()
        try:
            config_from_dict({"executor": executor, "rollout": {"num_engines": num_engines}})
        except ValueError as exc:  # local: 10**6 engines do not fit
            assert str(exc).startswith("config: rollout.num_engines: the run needs at least "), exc
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return peak

    peak_bytes(1)  # the lazy imports of the check
    assert peak_bytes(10 ** 6) < 1 << 20  # a list of 10**6 entries: 8 MB


def base(**overrides):
    data = {"rollout": {"group_size": 2}, "train": {"batch_size": 4, "max_staleness": 1}}
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        data.setdefault(section, {})[name] = value
    return data


def test_push_every_beyond_the_staleness_bound_is_refused_in_one_line():
    config_from_dict(base(train__optim={"push_every": 2}))  # max_staleness 1: a push every 2 steps keeps up
    with pytest.raises(ValueError) as err:
        config_from_dict(base(train__optim={"push_every": 3}))
    assert "train.optim.push_every: expected <= train.max_staleness + 1 = 2" in str(err.value)
    assert "got 3" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,value,match", [
    ("rollout__engine_urls", ["http://127.0.0.1"], r"rollout.engine_urls\[0\]"),
    ("rollout__engine_urls", [], "rollout.engine_urls"),
    ("rollout__weight_sync", "nccl", "rollout.weight_sync"),
    ("rollout__sync_backend", "mpi", "rollout.sync_backend"),
    ("rollout__sync_bucket_mb", 0, "rollout.sync_bucket_mb"),
    ("rollout__devices", "cuda:0,cuda:1", "one device per engine"),
    ("train__device", "tpu:0", "train.device"),
    ("train__max_idle_minutes", 0, "train.max_idle_minutes"),
    ("rollout__api_key", "", "rollout.api_key"),
])
def test_fleet_keys_are_checked(key, value, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(base(**{key: value}))


def test_remote_engine_urls_are_accepted_when_listed():
    cfg = config_from_dict(base(rollout__engine_urls=["http://10.1.2.3:30000", "http://localhost:30001"]))
    assert cfg.rollout.engine_urls[0] == "http://10.1.2.3:30000"


def test_sglang_weight_versions_become_trainer_versions():
    assert parse_weight_version("default") == 0 and parse_weight_version("12") == 12 and parse_weight_version(3) == 3
    for bad in ("v3", -1, True, None, "1e3"):
        with pytest.raises(ValueError, match="meta_info.weight_version"):
            parse_weight_version(bad)
    spans = {"weight_version": "3", "weight_versions": [{"version": "2", "start": 0, "end": 2},
                                                        {"version": "3", "start": 2, "end": 3}]}
    assert token_versions(spans, 3) == [2, 2, 3]
    assert token_versions({"weight_version": "default"}, 2) == [0, 0]
    with pytest.raises(ValueError, match="weight_versions"):
        token_versions(spans, 4)


def test_a_starving_trainer_ends_the_run_non_zero_with_the_reason(tmp_path, capsys):
    import yaml

    from glm5_core.cli import main
    from glm5_core.rl.serving.protocol import Limits
    from glm5_core.rl.serving.server import EngineServer
    from tests.rl.serving.test_server_hostile_clients import NeverFinishingEngine

    engine = NeverFinishingEngine()  # takes requests, never answers one
    engine.limits = Limits(vocab_size=264, max_input_tokens=63, max_new_tokens=8)
    server = EngineServer(engine).start()
    try:
        cfg = {"seed": 0, "mode": "async", "output_dir": str(tmp_path / "run"), "max_minutes": 5, "max_steps": 3,
               "env": {"name": "calculator", "max_numbers": 2, "max_new_tokens": 4},
               "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
               "rollout": {"max_batch": 4, "max_len": 64, "group_size": 2, "max_inflight_groups": 1,
                           "episode_threads": 4},
               "train": {"batch_size": 2, "max_staleness": 4, "max_idle_minutes": 0.05}}
        (tmp_path / "rl.yaml").write_text(yaml.safe_dump(cfg))
        rc = main(["rl", "--config", str(tmp_path / "rl.yaml"), "--engine-url", server.url, "--backend", "cpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1
        assert len(err) == 1 and "no training batch for" in err[0] and "train.max_idle_minutes=0.05" in err[0]
    finally:
        server.shutdown()
