"""Partial-rollout masking (``train.mask_offpolicy``, slime's --mask-offpolicy-in-partial-rollout): the mask
covers exactly the sampled tokens of older versions; prompt / tool tokens and the rest are untouched."""
import pytest

from glm5_core.rl.algorithm.offpolicy_mask import mask_offpolicy
from glm5_core.rl.config_loader import config_from_dict
from glm5_core.rl.rollout.trajectory import Sample, Trajectory


def partial_rollout() -> Trajectory:
    """Turn 1 sampled under v3 then paused at a push and resumed under v4; a tool result; turn 2 under v5."""
    sample = Sample()
    sample.append([1, 2], sampled=False)  # prompt
    sample.append([10, 11, 12, 13], sampled=True, logprobs=[-1.0] * 4, versions=[3, 3, 4, 4])
    sample.append([7], sampled=False)  # tool result
    sample.append([20, 21], sampled=True, logprobs=[-1.0] * 2, versions=[5, 5])
    return Trajectory("g0-0", "g0", [sample], 1.0)


def test_partial_masks_the_tokens_older_than_the_trajectory_newest():
    (t,), n = mask_offpolicy([partial_rollout()], policy_version=6, setting="partial")
    assert t.samples[0].loss_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert n == 4


def test_x_masks_the_tokens_more_than_x_versions_behind_the_policy():
    (t,), n = mask_offpolicy([partial_rollout()], policy_version=6, setting=2)  # keeps v4, v5
    assert t.samples[0].loss_mask == [0, 0, 0, 0, 1, 1, 0, 1, 1]
    assert n == 2
    (t,), n = mask_offpolicy([partial_rollout()], policy_version=6, setting=0)  # nothing is at v6
    assert sum(t.samples[0].loss_mask) == 0 and n == 6


def test_off_leaves_the_batch_alone_and_the_input_is_not_modified():
    batch = [partial_rollout()]
    assert mask_offpolicy(batch, 6, None) == (batch, 0)
    mask_offpolicy(batch, 6, "partial")
    assert batch[0].samples[0].loss_mask == [0, 0, 1, 1, 1, 1, 0, 1, 1]


def test_the_config_option(tmp_path):
    assert config_from_dict({"output_dir": str(tmp_path), "train": {"mask_offpolicy": 1}}).train.mask_offpolicy == 1
    with pytest.raises(ValueError, match=r"train.mask_offpolicy: expected null, 'partial' or an int >= 0"):
        config_from_dict({"output_dir": str(tmp_path), "train": {"mask_offpolicy": "all"}})
