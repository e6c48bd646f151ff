"""The RL trainer on the pretraining driver's parallel layout (``train.fsdp.parallelize``: expert parallelism on a
2-D DeviceMesh + FSDP2), on 2 gloo processes: at EP=2 the policy loss, gradient norm and updated weights of two
steps agree with ONE process training the same batch without expert parallelism (fp32 tolerance table: the EP
layer runs the batch-invariant experts, the one-process policy the plain kernel), with an uneven split of the
samples over the ranks (5 samples, micro-batches of 2: rank 1 runs a weight-0 stand-in) and the whole policy
gathered by ``save_weights`` on rank 0."""
import pytest
import torch.distributed as dist

from tests.ops.test_ep import _spawn_target
from tests.rl.algorithm.parallel_trainer_run import worker


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_policy_trainer_at_ep2_on_two_ranks_matches_one_process(tmp_path, spawnable_test_modules):
    _spawn_target(worker, 2, tmp_path, timeout=300.0)


def test_the_statistics_are_summed_on_the_policys_device(monkeypatch):
    """NCCL / HCCL reduce only tensors on their device (a CPU tensor has no backend in their process group): the
    step's statistics go over the ranks on the policy's device, as every other collective of the step does. The
    device here is ``meta`` (this host has no accelerator): the stand-in all_reduce records where its tensor lives."""
    import types

    import torch

    from glm5_core.rl.algorithm.trainer import PolicyTrainer

    seen = []

    class Reduced(Exception):
        pass

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise Reduced

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    trainer = types.SimpleNamespace(device=torch.device("meta"))
    with pytest.raises(Reduced):
        PolicyTrainer._summed_over_ranks(trainer, {"loss": 1.0, "ratio": 2.0})
    assert seen == [torch.device("meta")]


@pytest.mark.parametrize("has_fp64", [True, False])
def test_the_statistics_are_reduced_in_fp64_only_where_the_device_computes_it(monkeypatch, has_fp64):
    """Several vendors' devices compute no fp64 (their DeviceFacts say so): the statistics go over in fp32 there."""
    import dataclasses
    import types

    import torch

    from glm5_core import device_kinds
    from glm5_core.rl.algorithm.trainer import PolicyTrainer

    cpu = device_kinds.facts_for("cpu")
    dtypes = cpu.dtypes if has_fp64 else cpu.dtypes - {torch.float64}
    monkeypatch.setattr(device_kinds, "facts_for", lambda t: dataclasses.replace(cpu, dtypes=frozenset(dtypes)))
    seen = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *a, **k: seen.append(tensor.dtype))
    out = PolicyTrainer._summed_over_ranks(types.SimpleNamespace(device=torch.device("cpu")), {"a": 1.5, "b": 2.0})
    assert seen == [torch.float64 if has_fp64 else torch.float32] and out == {"a": 1.5, "b": 2.0}
