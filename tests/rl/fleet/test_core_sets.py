"""CPU core sets as devices (issue 33 item 5): ``train.device: cpu:0`` / ``rollout.devices: [cpu:1]`` pin the
trainer's process and each engine worker with ``os.sched_setaffinity``, one torch thread per core; overlapping
sets and cores outside ``os.sched_getaffinity(0)`` are refused in one line."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from glm5_core.rl.config import check_core_sets, core_set, parse_device, parse_devices, torch_device_name
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.fleet.placement import check_cores, check_visible

HAS_AFFINITY = hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


def test_core_set_syntax():
    assert core_set("cpu:2", "k") == (2,)
    assert core_set("cpu:0-3", "k") == (0, 1, 2, 3)
    assert core_set("cpu:4+0-1", "k") == (0, 1, 4)
    assert core_set("cpu", "k") is None  # the bare host device keeps its meaning: no pinning
    assert parse_device("cpu:0-1", "k") == ("cpu", 0)
    assert parse_devices("cpu:0-1+2,cpu:5", "k") == ["cpu:0-2", "cpu:5"]
    assert parse_devices(["cpu:3"], "k") == ["cpu:3"]
    assert torch_device_name("cpu:0-1") == "cpu"
    with pytest.raises(ValueError, match=r"^k: expected a core range low-high"):
        core_set("cpu:3-1", "k")


def test_a_core_set_on_an_accelerator_is_refused():
    from glm5_core import device_kinds

    accel = next((k for k, f in device_kinds.device_types().items() if not f.is_host), None)
    if accel is None:
        pytest.skip("no accelerator device type is declared")
    with pytest.raises(ValueError, match=r"^train.device: expected an index for .*host device only"):
        parse_device(f"{accel}:0-1", "train.device")


def test_overlapping_sets_are_refused_in_one_line(tmp_path):
    check_core_sets("cpu:0", ["cpu:1", "cpu:2"])  # disjoint: fine
    check_core_sets("cpu", ["cpu", "cpu"])  # the bare host device pins nothing
    with pytest.raises(ValueError, match=r"^rollout.devices\[0\]: expected CPU cores no other role is pinned to, "
                                         r"got cores \[1\] also in train.device$"):
        check_core_sets("cpu:0-1", ["cpu:1", "cpu:2"])
    with pytest.raises(ValueError, match=r"rollout.devices\[1\]: .* cores \[3\] also in rollout.devices\[0\]"):
        config_from_dict({"output_dir": str(tmp_path), "train": {"device": "cpu:0"},
                          "rollout": {"num_engines": 2, "devices": ["cpu:2-3", "cpu:3"]}})


@pytest.mark.skipif(not HAS_AFFINITY, reason="no os.sched_setaffinity on this platform")
def test_cores_outside_this_process_affinity_are_refused():
    allowed = os.sched_getaffinity(0)
    outside = max(allowed) + 1
    check_cores((min(allowed),), "train.device", f"cpu:{min(allowed)}")
    with pytest.raises(ValueError, match=rf"^rollout.devices: cores \[{outside}\] of cpu:{outside} are not in this "
                                         r"process's affinity"):
        check_visible([f"cpu:{outside}"], "rollout.devices", probe=dict)


RUN = textwrap.dedent("""
    import json, os, sys, torch
    from glm5_core.rl.config_loader import config_from_dict
    from glm5_core.rl.driver import RLRun
    trainer, engines = sys.argv[2], json.loads(sys.argv[3])
    cfg = config_from_dict({
        "seed": 0, "mode": "sync", "output_dir": sys.argv[1], "max_minutes": 5, "max_steps": 1,
        "env": {"name": "arithmetic", "max_operand": 4, "max_new_tokens": 1},
        "model": {"preset": "tiny", "overrides": {"index_topk": 8}},
        "rollout": {"num_engines": len(engines), "max_batch": 4, "max_len": 32, "group_size": 2,
                    "devices": engines},
        "train": {"batch_size": 2, "device": trainer}, "eval": {"every": 0, "samples_per_problem": 1}})
    seen = {}
    def look(step, run):
        seen["trainer"] = sorted(os.sched_getaffinity(0))
        seen["trainer_threads"] = torch.get_num_threads()
        seen["engines"] = [sorted(os.sched_getaffinity(run.executor.pid(f"engine{i}"))) for i in range(len(engines))]
    RLRun(cfg, hooks=[look], log=lambda m: None).run()
    seen["after"] = sorted(os.sched_getaffinity(0))  # the run gives the caller its cores back
    print("AFFINITY " + json.dumps(seen))
""")


@pytest.mark.slow  # a whole run (~1-3 min on 2 shared cores); the pinning itself: the fast test below
@pytest.mark.skipif(not HAS_AFFINITY or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin to")
def test_trainer_and_spawned_engine_workers_run_on_the_cores_asked_for(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    trainer, engine = f"cpu:{cores[0]}", f"cpu:{cores[1]}"
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), trainer, json.dumps([engine])],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.split("AFFINITY ", 1)[1])
    assert seen == {"trainer": [cores[0]], "trainer_threads": 1, "engines": [[cores[1]]], "after": cores}


PIN = textwrap.dedent("""
    import json, os, sys, threading, torch
    from glm5_core.rl.fleet.placement import pin_trainer
    from glm5_core.rl.serving.worker import pin_to_cores
    torch.set_num_threads(7)
    started, stop = threading.Event(), threading.Event()
    tid = []
    def earlier():  # a thread started before the pin (as torch's intra-op pool may be)
        tid.append(threading.get_native_id()); started.set(); stop.wait()
    threading.Thread(target=earlier, daemon=True).start(); started.wait()
    pin_to_cores(tuple(json.loads(sys.argv[1])))
    worker = [sorted(os.sched_getaffinity(0)), torch.get_num_threads(), sorted(os.sched_getaffinity(tid[0]))]
    pin_trainer(sys.argv[2], 3)
    print("PINNED " + json.dumps({"worker": worker, "trainer": [sorted(os.sched_getaffinity(0)),
                                                                 torch.get_num_threads(),
                                                                 sorted(os.sched_getaffinity(tid[0]))]}))
""")


@pytest.mark.skipif(not HAS_AFFINITY, reason="no os.sched_setaffinity on this platform")
def test_a_worker_and_the_trainer_pin_themselves_with_one_torch_thread_per_core():
    cores = sorted(os.sched_getaffinity(0))
    worker, trainer = cores[:2], cores[-1]
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PIN, json.dumps(worker), f"cpu:{trainer}"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.split("PINNED ", 1)[1]) == {"worker": [worker, len(worker), worker],
                                                             "trainer": [[trainer], 1, [trainer]]}
