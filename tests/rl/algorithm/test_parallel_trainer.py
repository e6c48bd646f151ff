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
