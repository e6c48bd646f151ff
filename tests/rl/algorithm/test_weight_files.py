"""The RL trainer's weight files (``v{version}.safetensors``): pruned by this trainer's write history, not by
name, so a second `glm5 rl` into the same output directory keeps (and can pin) the files it writes."""
import pytest

from glm5_core.rl.algorithm.trainer import PolicyTrainer, TrainerConfig
from glm5_core.rl.fleet.executors.boot_weights import BootWeights
from glm5_core.rl.serving.worker import WorkerSpec


@pytest.fixture
def trainer(tiny_policy):
    return PolicyTrainer(tiny_policy, TrainerConfig(), temperature=1.0)


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_a_rerun_into_a_folder_of_an_earlier_run_keeps_and_pins_its_weights(trainer, tmp_path):
    earlier = [f"v{v:06d}.safetensors" for v in (40, 41, 42)]
    for name in earlier:  # what the earlier run left
        (tmp_path / name).write_bytes(b"earlier run")
    path = trainer.save_weights(str(tmp_path))
    assert path.endswith("v000000.safetensors") and _names(tmp_path) == ["v000000.safetensors", *earlier]
    spec = WorkerSpec({}, path, 0, str(tmp_path))
    pinned = BootWeights(spec_attempts=1).pin("engine0", lambda name: spec)  # failed on 231de35: pruned at once
    assert pinned.weights_path.endswith("boot-engine0.safetensors") and pinned.weight_version == 0


def test_only_this_trainers_older_files_are_pruned(trainer, tmp_path):
    (tmp_path / "v000040.safetensors").write_bytes(b"earlier run")
    for _ in range(5):
        trainer.save_weights(str(tmp_path), keep=3)
        trainer.step_count += 1  # the version of the next push
    assert _names(tmp_path) == ["v000002.safetensors", "v000003.safetensors", "v000004.safetensors",
                                "v000040.safetensors"]
    trainer.step_count = 4
    trainer.save_weights(str(tmp_path), keep=3)  # the newest version re-written: still 3 files of this run
    assert _names(tmp_path) == ["v000002.safetensors", "v000003.safetensors", "v000004.safetensors",
                                "v000040.safetensors"]
